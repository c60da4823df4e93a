"""``moe-dist ... --nproc N``: start N ranks on this machine and stay responsible for them.

The launcher starts every rank itself (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT`` on a free local port, as torchrun would set them), each in a
session of its own and tied to the launcher's life (``PR_SET_PDEATHSIG``: a launcher killed
with SIGKILL takes its ranks with it). Then:

* signals: SIGTERM, SIGUSR1 and SIGHUP are passed on, unchanged, to every rank (the trainer
  checkpoints at the next step, exits with 75 and names the signal); SIGINT (Ctrl-C) is passed
  on as SIGINT (ranks stop at once, quietly), a second SIGINT kills them. ``train`` ranks start
  with those three ignored (a rank still importing torch would die of them) and the launcher
  notes the stop in the job's status directory, where the trainer reads it once its handlers are
  in place (:func:`moe_dist.exits.stop_requested`): a stop asked for at any moment checkpoints;
* when a rank fails, the others get a few seconds to end on their own and are then killed:
  no rank is left waiting in a collective;
* the exit code is the job's (see :mod:`moe_dist.exits`), and what is printed is the one
  report that explains it: a user error's line (rank 0's, already printed), the traceback of
  the rank whose internal error started it, a timed-out collective, or one line naming a
  rank killed by the system.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from .exits import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE, REPORT_DIR_ENV, killed_line,
                    note_stop_request, read_report)
from .ports import free_port

GRACE_S = 5.0  # after a rank fails, how long the others may take to end on their own
FORWARDED = ("SIGTERM", "SIGUSR1", "SIGHUP")
HANDLES_STOPS = ("train",)  # commands whose ranks checkpoint and exit 75 on a stop signal
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: its own session, and SIGKILL when the launcher dies."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the launcher's own handlers still stop the ranks
        pass


def _die_with_parent_ignoring_stops() -> None:
    """:func:`_die_with_parent`, and the forwarded stop signals ignored until the trainer handles them."""
    _die_with_parent()
    for name in FORWARDED:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def default_threads(nproc: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores // nproc)


class LocalJob:
    """N ranks of ``python -m moe_dist.cli <argv>`` and what happened to them."""

    def __init__(self, nproc: int, argv: Sequence[str], command: str):
        self.nproc, self.argv, self.command = nproc, list(argv), command
        self.procs: list[subprocess.Popen] = []
        self.report_dir = tempfile.mkdtemp(prefix="moe-dist-ranks-")
        self.signalled: Optional[str] = None  # the first stop signal the launcher received
        self.interrupts = 0
        self.killed_by_us: set[int] = set()

    # ---- start --------------------------------------------------------------------------------------
    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                               "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")}
        env.setdefault("OMP_NUM_THREADS", str(default_threads(self.nproc)))
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(self.nproc),
                   LOCAL_WORLD_SIZE=str(self.nproc), MOE_DIST_LAUNCHER="local",
                   **{REPORT_DIR_ENV: self.report_dir})
        cmd = [sys.executable, "-m", "moe_dist.cli", *self.argv]
        before_exec = _die_with_parent_ignoring_stops if self.command in HANDLES_STOPS else _die_with_parent
        for rank in range(self.nproc):
            self.procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                               preexec_fn=before_exec))

    # ---- signals ------------------------------------------------------------------------------------
    def _send(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, sig)
                except ProcessLookupError:
                    pass

    def _on_stop_signal(self, signum, _frame) -> None:
        self.signalled = self.signalled or signal.Signals(signum).name
        note_stop_request(self.report_dir, self.signalled)
        self._send(signum)

    def _on_interrupt(self, _signum, _frame) -> None:
        self.interrupts += 1
        if self.interrupts == 1:
            self._send(signal.SIGINT)
        else:
            self._kill_all()

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                self.killed_by_us.add(p.pid)
        self._send(signal.SIGKILL)

    # ---- wait ---------------------------------------------------------------------------------------
    def wait(self) -> list[int]:
        """Wait for every rank; after the first failure, give the rest GRACE_S then kill them."""
        failed_at = None
        while True:
            codes = [p.poll() for p in self.procs]
            if all(c is not None for c in codes):
                return codes
            failure = any(c is not None and c not in (EXIT_OK, EXIT_PREEMPTED) for c in codes)
            if (failure or self.interrupts) and failed_at is None:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                self._kill_all()
            time.sleep(0.05)

    def run(self) -> int:
        handlers = {}
        try:
            for name in FORWARDED:
                handlers[getattr(signal, name)] = signal.signal(getattr(signal, name), self._on_stop_signal)
            handlers[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)
            self.start()
            codes = self.wait()
            return self.outcome(codes)
        finally:
            if self.procs:  # an error of the launcher itself: leave nothing running
                self._kill_all()
                for p in self.procs:
                    p.wait()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            shutil.rmtree(self.report_dir, ignore_errors=True)

    # ---- the outcome --------------------------------------------------------------------------------
    def _say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def outcome(self, codes: list[int]) -> int:
        """The job's exit code, and the one report worth printing."""
        reports = [read_report(self.report_dir, r) or {} for r in range(self.nproc)]
        kinds = [rep.get("kind") for rep in reports]
        prefix = f"moe-dist {self.command}"
        if all(c == EXIT_OK for c in codes):
            return EXIT_OK
        if EXIT_USAGE in codes:  # rank 0 printed the one line; the others left quietly
            return EXIT_USAGE
        if self.interrupts and not self.signalled:
            self._say(f"{prefix}: interrupted (Ctrl-C): stopped {self.nproc} process(es); resume=auto continues from "
                      "the last complete checkpoint")
            return EXIT_INTERRUPTED
        stopped = [r for r, k in enumerate(kinds) if k == "stopped"]
        if stopped:  # a stated reason (every rank has it): one line
            self._say(reports[stopped[0]]["line"])
            return codes[stopped[0]] if codes[stopped[0]] > 0 else EXIT_FAILED
        errors = [r for r, k in enumerate(kinds) if k == "error"]
        if errors:  # an internal error: its traceback, from the rank where it happened
            rank = errors[0]
            self._say(reports[rank]["traceback"].rstrip())
            others = [r for r in range(self.nproc) if r != rank and codes[r] != EXIT_OK]
            self._say(f"{prefix}: rank {rank} failed (exit code {codes[rank]})"
                      + (f"; rank(s) {', '.join(map(str, others))} stopped with it" if others else ""))
            return EXIT_FAILED
        killed = [r for r, c in enumerate(codes) if c < 0 and self.procs[r].pid not in self.killed_by_us]
        if killed and not self.signalled:
            rank, sig = killed[0], -codes[killed[0]]
            self._say(killed_line(self.command, rank, self.procs[rank].pid, sig))
            return 128 + sig
        timeouts = [r for r, k in enumerate(kinds) if k in ("timeout", "peer_lost")]
        if timeouts and not self.signalled:
            first = next((r for r in timeouts if kinds[r] == "timeout"), timeouts[0])
            self._say(reports[first]["line"])
            return EXIT_FAILED
        if self.signalled:  # stopped on request: a checkpoint was saved (or the run had not started)
            return EXIT_PREEMPTED
        if all(c in (EXIT_OK, EXIT_PREEMPTED) for c in codes):
            return EXIT_PREEMPTED
        bad = next(c for c in codes if c not in (EXIT_OK, EXIT_PREEMPTED))
        self._say(f"{prefix}: a rank exited with code {bad}")
        return bad if 0 < bad < 256 else EXIT_FAILED


def launch_local(nproc: int, argv: Sequence[str], command: str = "train") -> int:
    """Run ``moe-dist <argv>`` as ``nproc`` local ranks; returns the job's exit code."""
    return LocalJob(nproc, argv, command).run()
