"""How one process of a job ends: its exit code, what it prints, and its report to the local launcher.

Exit codes (the same from one process, from ``moe-dist ... --nproc N`` and from the launch scripts):

    0    done
    1    failed: an internal error (with its traceback), a collective that timed out, training that
         diverged (too many consecutive non-finite steps)
    2    bad input: configuration, data, checkpoint, command line (one line, printed once)
    75   stopped by SIGTERM / SIGUSR1 / SIGHUP after saving a checkpoint: requeue, ``resume=auto`` continues
    130  interrupted (Ctrl-C)
    128+N  a rank was killed by signal N (``--nproc`` only)

Under ``moe-dist --nproc N`` (:mod:`moe_dist.local_launch`) every rank writes what ended it to
``$MOE_DIST_REPORT_DIR/rank_<r>.json`` instead of printing tracebacks, and the launcher shows the
one that explains the failure; elsewhere (torchrun, srun, mpirun, one process) a rank prints
its own: a traceback for an internal error, one line for a timed-out collective, a lost peer or
an interruption. The launch scripts set ``MOE_DIST_STATUS_DIR``: ranks print as usual and
also report, and ``read_reports`` in launch/lib.sh turns the launcher's exit status (torchrun
says 1 for any failure, MPICH ORs the ranks' codes) back into the job's and names the lost nodes.

The report is one line of flat JSON (:func:`write_report`) so that a shell reads it without
Python (the batch host of a container job has no project Python): ``"code": N`` (the rank's exit
code), ``"lost": "NODE ..."`` (for a failed rank, the nodes its line names as lost, space-separated
host names) and ``"host"``; the other fields (``kind``, ``line``, ``traceback``) are for people and
the Python launchers. A string never holds an unescaped ``"``, so ``"code": `` and ``"lost": "``
occur once, as keys.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import traceback
from typing import Callable, Optional

from .errors import UserError
from .safe_io import write_json_atomically

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: checkpoint saved, please requeue
EXIT_INTERRUPTED = 130
REPORT_DIR_ENV = "MOE_DIST_REPORT_DIR"  # report instead of printing (moe-dist --nproc)
STATUS_DIR_ENV = "MOE_DIST_STATUS_DIR"  # report and print as usual (the launch scripts: torchrun, mpirun)
STOP_REQUEST = "stop_requested"  # in the status directory: the launcher was asked to stop the job (launch/lib.sh)
KINDS = {EXIT_OK: "ok", EXIT_USAGE: "usage", EXIT_PREEMPTED: "preempted", EXIT_INTERRUPTED: "interrupted"}


class JobStopped(Exception):
    """The run ended for a reason it states in one line (no traceback): training that diverged,
    a checkpoint that cannot be written. ``exit_code`` is the process's."""

    exit_code = EXIT_FAILED


def process_rank() -> int:
    """This process's rank as its launcher set it (0 without one)."""
    for var in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"):
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def write_report(directory: str, rank: int, report: dict) -> None:
    """Atomically write ``rank_<rank>.json`` (best effort: a full disk must not hide the real error),
    with the shell-readable fields of the module's docstring: ``lost`` and ``host`` added."""
    from .distributed.roll_call import named_nodes

    path = os.path.join(directory, f"rank_{rank}.json")
    lost = named_nodes(str(report.get("line", ""))) if report.get("code") == EXIT_FAILED else []
    report = {**report, "lost": " ".join(lost), "host": socket.gethostname()}
    try:
        write_json_atomically(path, report, indent=None)
    except OSError:
        pass


def note_stop_request(directory: str, signal_name: str) -> None:
    """A launcher was asked to stop the job: say so in its status directory (best effort)."""
    try:
        with open(os.path.join(directory, STOP_REQUEST), "w", encoding="utf-8") as f:
            f.write(signal_name + "\n")
    except OSError:
        pass


def stop_requested() -> Optional[str]:
    """The signal name a launcher wrote into its status directory (``$MOE_DIST_STATUS_DIR``, or
    ``$MOE_DIST_REPORT_DIR`` under ``--nproc``) when it was asked to stop the job, or None. A rank
    still starting up ignores the signal the launcher passes on, so it asks here once it can handle
    one (:class:`moe_dist.train.loop.preemption.PreemptionHandler`)."""
    directory = os.environ.get(REPORT_DIR_ENV) or os.environ.get(STATUS_DIR_ENV)
    if not directory:
        return None
    try:
        with open(os.path.join(directory, STOP_REQUEST), encoding="utf-8") as f:
            return f.read().strip() or "SIGUSR1"
    except OSError:
        return None


def read_report(directory: str, rank: int) -> Optional[dict]:
    try:
        with open(os.path.join(directory, f"rank_{rank}.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _collective_failure(exc: BaseException, rank: int, command: str) -> Optional[tuple[str, str]]:
    """(kind, one line) for a collective that timed out or lost its peer, else None."""
    from .distributed.collective_errors import failed_collective
    from .distributed.groups import group_timeout

    info = failed_collective(exc)
    if info is None or not (info.timed_out or info.peer_lost):
        return None
    from .distributed.roll_call import lost_nodes_line, roll_call_wait

    timeout = group_timeout()
    seconds = timeout.total_seconds() if timeout else None
    line = f"moe-dist {command}: rank {rank}: " + info.describe(seconds)
    lost = lost_nodes_line(roll_call_wait(seconds))  # "" on one host
    if lost:
        line += f"; {lost}"
    return ("timeout" if info.timed_out else "peer_lost"), line


def exit_code_of(exc: Optional[BaseException]) -> int:
    """The exit code a process ends with when ``exc`` ends it (None: it is done): a SystemExit's own
    code (75 for a preemption), a JobStopped's, 2 for a user error, 130 for Ctrl-C, otherwise 1."""
    if exc is None:
        return EXIT_OK
    if isinstance(exc, SystemExit):
        return exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_FAILED)
    if isinstance(exc, JobStopped):
        return exc.exit_code
    if isinstance(exc, UserError):
        return EXIT_USAGE
    return EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else EXIT_FAILED


def _report(directory: str, rank: int, code: int, kind: str, line: str, trace: str) -> None:
    """This process's report to its launcher (:func:`write_report`)."""
    write_report(directory, rank, {"rank": rank, "pid": os.getpid(), "code": code, "kind": kind, "line": line,
                                   "traceback": trace})


_command = "run"  # the command this process runs (run_process): the prefix of end_process's line


def end_process(line: str, kind: str) -> None:
    """End this process now with one line ``moe-dist COMMAND: LINE`` (printed, and reported to the
    launcher as :func:`run_process` would) and exit code 1, from any thread: for a rank whose main
    thread may be blocked in a collective that nothing in Python interrupts."""
    report_dir, rank = os.environ.get(REPORT_DIR_ENV), process_rank()
    status_dir = report_dir or os.environ.get(STATUS_DIR_ENV)
    full = f"moe-dist {_command}: {line}"
    if not report_dir:
        print(full, file=sys.stderr, flush=True)
    if status_dir:
        _report(status_dir, rank, EXIT_FAILED, kind, full, "")
    sys.stdout.flush()
    os._exit(EXIT_FAILED)


def run_process(command: str, fn: Callable[[], int]) -> int:
    """Run one process's command ``fn`` and return its exit code (``SystemExit`` passes through
    with its code). Reports to the local launcher when ``MOE_DIST_REPORT_DIR`` is set."""
    global _command
    _command = command
    report_dir, rank = os.environ.get(REPORT_DIR_ENV), process_rank()
    status_dir = report_dir or os.environ.get(STATUS_DIR_ENV)
    code, kind, line, trace = EXIT_FAILED, "error", "", ""
    try:
        code = int(fn() or 0)
        kind = KINDS.get(code, "error")
        return code
    except SystemExit as e:  # Preempted (75) and friends: their code, unchanged
        code = exit_code_of(e)
        kind = KINDS.get(code, "error")
        raise
    except JobStopped as e:
        code, kind, line = exit_code_of(e), "stopped", f"moe-dist {command}: {e}"
        if not report_dir and rank == 0:
            print(line, file=sys.stderr, flush=True)
        return code
    except KeyboardInterrupt as e:
        code, kind = exit_code_of(e), "interrupted"
        line = f"moe-dist {command}: interrupted"
        if not report_dir and rank == 0:
            print(line, file=sys.stderr, flush=True)
        return code
    except BaseException as e:  # noqa: BLE001 - reported, then the process ends with EXIT_FAILED (DCP raises
        # CheckpointException, a BaseException)
        trace = traceback.format_exc()
        found = _collective_failure(e, rank, command)
        if found:
            kind, line = found
        if not report_dir:
            print(line or trace.rstrip(), file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        if status_dir:
            _report(status_dir, rank, code, kind, line, trace)


def killed_line(command: str, rank: int, pid: int, signum: int) -> str:
    """One line for a rank that a signal killed (it could not report: SIGKILL is often the
    out-of-memory killer)."""
    name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else f"signal {signum}"
    cause = " (out of memory?)" if signum == signal.SIGKILL else ""
    return (f"moe-dist {command}: rank {rank} (pid {pid}) was killed by {name}{cause}; the job stopped. resume=auto "
            "continues from the last complete checkpoint")
