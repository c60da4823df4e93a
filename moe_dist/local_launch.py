"""Run torchrun for ``moe-dist ... --nproc N`` and pass stop signals on to its workers.

``docker stop`` (SIGTERM), a scheduler's warning (SIGUSR1) or ``kill`` sent to the launcher
reach the training processes as SIGUSR1, which they handle by saving a checkpoint at the next
step boundary and exiting with :data:`~moe_dist.train.preemption.EXIT_PREEMPTED` (see
:mod:`moe_dist.train.preemption`); the launcher then exits with that code too. This is the rule
of ``launch/lib.sh: run_forwarding_signals children`` for the Python launcher: torchrun itself
starts with those signals ignored and is told not to handle SIGTERM, so a signal sent to the
whole process tree (or to a container's PID 1) cannot stop it before its workers have saved.
A launcher that is PID 1 of a container gets the signal only because it installs a handler.
"""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Mapping, Sequence

from .train.preemption import EXIT_PREEMPTED, SIGNALS


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(k) for k in f.read().split()]
    except OSError:  # no /proc (not Linux) or the process is gone
        pass
    return kids


def _ignore_stop_signals() -> None:  # in the child, before exec: torchrun starts with them ignored
    for name in SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def run_forwarding_stop_signals(cmd: Sequence[str], env: Mapping[str, str]) -> int:
    """Run ``cmd`` (torchrun) and wait; SIGTERM/SIGUSR1 reach its children as SIGUSR1.

    Returns the command's exit code, or EXIT_PREEMPTED when a stop signal came and the
    command did not finish cleanly (its workers saved and stopped), or 130 on Ctrl-C.
    """
    env = dict(env)
    # torchrun would turn SIGTERM into "kill the workers within 30 s"; they handle it themselves
    env.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGINT,SIGHUP,SIGQUIT")
    proc = subprocess.Popen(list(cmd), env=env, preexec_fn=_ignore_stop_signals)
    received: list[str] = []

    def forward(signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if not received:
            print(f"[moe-dist] {name} received: asking the training processes to checkpoint and stop", flush=True)
        received.append(name)
        for kid in _children(proc.pid):
            try:
                os.kill(kid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    previous: dict[int, object] = {}
    for name in SIGNALS:
        sig = getattr(signal, name)
        previous[sig] = signal.signal(sig, forward)
    try:
        rc = proc.wait()
    except KeyboardInterrupt:  # torchrun got the SIGINT too and stops its workers
        proc.wait()
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return EXIT_PREEMPTED if received and rc != 0 else rc

