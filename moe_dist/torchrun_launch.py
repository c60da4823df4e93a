"""``python -m moe_dist.torchrun_launch [torchrun arguments]``: torchrun whose report of a failed job
is the job's own (launch/torchrun.sh runs torchrun through it).

torchrun (``torch.distributed.run``) alone ends a failed job with a ChildFailedError traceback,
a table of the failed workers and a log line for each worker it stops, after the ranks have
already said what ended them (rank 0's one line for bad input, the traceback of an internal
error, one line for a timed-out collective: :mod:`moe_dist.exits`). Here torchrun runs in this
process without those: its routine teardown lines are filtered out, and a ChildFailedError
prints nothing more when the rank that failed first ended on its own (it reported in
``$MOE_DIST_STATUS_DIR``, which launch/lib.sh sets, and printed its account), else one line
naming it (killed by a signal, or its exit code). The exit status stays torchrun's (1 for a
failed job; launch/lib.sh turns it into the job's, see :func:`moe_dist.exits.job_exit_code`).
torchrun's other errors (its arguments, the rendezvous) keep their tracebacks, but for one: the
agent of a node other than the first loses the rendezvous store (RendezvousConnectionError) when
the first node's agent, which holds it, has ended. That is how every job that stops on all nodes
at once ends for the other nodes (a preemption: ``docker stop`` or ``scancel --signal`` on every
node; the first node's agent exits as soon as its ranks have); when this node's ranks reported
how they ended, nothing more is printed (launch/lib.sh turns their reports into the job's exit
code), else one line naming the store. The agent's own C++ warnings (the store connection's
stack dumps) are off (``TORCH_CPP_LOG_LEVEL=ERROR`` for this process only, unless set); the
workers keep theirs.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Optional, Sequence

from .exits import EXIT_FAILED, EXIT_OK, STATUS_DIR_ENV, killed_line, read_report

WORKER_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # torchrun's starting and stopping of workers
RENDEZVOUS_LOGGER = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
ROUTINE_TEARDOWN = ("failed (exitcode:", "Sending process ", "Closing process ")  # how its messages begin


class _RoutineTeardown(logging.Filter):
    """Drops torchrun's lines about a failed worker and the workers it stops after it (kept: a
    worker that would not stop)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(ROUTINE_TEARDOWN)


class _StoreGone(logging.Filter):
    """Drops the rendezvous's warning that this node could not close a rendezvous whose store has
    gone (the line :func:`store_lost_line` stands for)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        return not ("has failed to shutdown the rendezvous" in msg and "RendezvousConnectionError" in msg)


def command_of(argv: Sequence[str]) -> str:
    """The moe-dist command the workers run: the word after ``moe_dist.cli`` (default ``train``)."""
    args = list(argv)
    for i, arg in enumerate(args[:-1]):
        if arg == "moe_dist.cli":
            return args[i + 1]
    return "train"


def first_failure(failures: dict) -> tuple[int, object]:
    """``(rank, ProcessFailure)`` that started the failure: the earliest, leaving out the workers
    torchrun itself stopped with SIGTERM after it (when another one failed), a rank killed by a
    signal first within the same second (timestamps are whole seconds)."""
    items = sorted(failures.items())
    own = [(r, f) for r, f in items if f.exitcode != -signal.SIGTERM] or items
    return min(own, key=lambda rf: (rf[1].timestamp, rf[1].exitcode >= 0, rf[0]))


def failure_line(command: str, failures: dict, status_dir: Optional[str]) -> Optional[str]:
    """The line to print for a failed job, or None when the rank that failed first reported how it
    ended (it printed that itself)."""
    rank, failure = first_failure(failures)
    if status_dir and read_report(status_dir, rank) is not None:
        return None
    if failure.exitcode < 0:
        return killed_line(command, rank, failure.pid, -failure.exitcode)
    return f"moe-dist {command}: rank {rank} (pid {failure.pid}) exited with code {failure.exitcode}; the job stopped"


def rendezvous_endpoint(argv: Sequence[str]) -> str:
    """torchrun's ``--rdzv-endpoint`` (either spelling, ``=VALUE`` or the next argument), or ``?``."""
    args = list(argv)
    for i, arg in enumerate(args):
        for flag in ("--rdzv-endpoint", "--rdzv_endpoint"):
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
            if arg == flag and i + 1 < len(args):
                return args[i + 1]
    return "?"


def store_lost_line(command: str, argv: Sequence[str], status_dir: Optional[str]) -> Optional[str]:
    """The line for an agent that lost the rendezvous store, or None when this node's ranks reported
    how they ended (they ended on their own, before or with the first node)."""
    if status_dir and os.path.isdir(status_dir) and any(n.startswith("rank_") for n in os.listdir(status_dir)):
        return None
    return (f"moe-dist {command}: this node's torchrun lost the job's rendezvous store at {rendezvous_endpoint(argv)} "
            "(the first node ended, or this node cannot reach it any more); the job stopped")


def _import_torch_quietly() -> None:
    """Import torch with its C++ warnings off in this process (the agent) but not in the workers
    it starts: the level is read when torch loads, the workers' environment is copied later."""
    if "torch" in sys.modules or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def main(argv: Sequence[str]) -> int:
    _import_torch_quietly()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.run import main as torchrun

    logging.getLogger(WORKER_LOGGER).addFilter(_RoutineTeardown())
    logging.getLogger(RENDEZVOUS_LOGGER).addFilter(_StoreGone())
    status_dir = os.environ.get(STATUS_DIR_ENV)
    try:
        torchrun(list(argv))
    except ChildFailedError as e:
        line = failure_line(command_of(argv), e.failures, status_dir)
        if line:
            print(line, file=sys.stderr, flush=True)
        return EXIT_FAILED
    except RendezvousConnectionError:
        line = store_lost_line(command_of(argv), argv, status_dir)
        if line:
            print(line, file=sys.stderr, flush=True)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
