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
torchrun's other errors (its arguments, the rendezvous) keep their tracebacks.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Optional, Sequence

from .exits import EXIT_FAILED, EXIT_OK, STATUS_DIR_ENV, killed_line, read_report

WORKER_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # torchrun's starting and stopping of workers
ROUTINE_TEARDOWN = ("failed (exitcode:", "Sending process ", "Closing process ")  # how its messages begin


class _RoutineTeardown(logging.Filter):
    """Drops torchrun's lines about a failed worker and the workers it stops after it (kept: a
    worker that would not stop)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(ROUTINE_TEARDOWN)


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


def main(argv: Sequence[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    logging.getLogger(WORKER_LOGGER).addFilter(_RoutineTeardown())
    try:
        torchrun(list(argv))
    except ChildFailedError as e:
        line = failure_line(command_of(argv), e.failures, os.environ.get(STATUS_DIR_ENV))
        if line:
            print(line, file=sys.stderr, flush=True)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
