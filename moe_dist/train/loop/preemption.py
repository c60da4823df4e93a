"""Stop cleanly when the scheduler asks: checkpoint at the next step boundary, then exit.

A cluster warns a job before it kills it: Slurm sends the signal named by
``#SBATCH --signal=B:USR1@<seconds>`` before the time limit (launch/slurm/train.sbatch
forwards it to every task), and SIGTERM when the job is preempted or reaches its limit; SIGHUP
(the terminal of an interactive run closed) is handled the same way. The log names the signal.
The handler installed here only sets a flag. After every optimizer step the trainer calls
:func:`stop_if_requested`, which agrees on the flag over all ranks (a MAX all-reduce, so all
ranks stop at the same step even if the signal reached only some of them), saves a
checkpoint unless this step already has one, and raises :class:`Preempted`: a
``SystemExit`` with :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``), which the launch scripts
read as "requeue me". The requeued job continues from that checkpoint with ``resume=auto``.

A stop asked for while the rank was still starting up (the launch scripts start their ranks with
the signals ignored, so that a signal to the whole process tree cannot kill them before they can
save) is not lost: the launcher also notes it in its status directory, and the handler, once in
place, reads the note (:func:`moe_dist.exits.stop_requested`) as if the signal had just arrived.

Repeated signals are harmless (one process may get the same signal from Slurm and from a
launcher that forwards it); a scheduler that will not wait sends SIGKILL anyway.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from ...exits import EXIT_PREEMPTED, stop_requested  # 75, EX_TEMPFAIL (moe_dist/exits.py defines every exit code)

SIGNALS = ("SIGUSR1", "SIGTERM", "SIGHUP")


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint; exits the process with code 75."""

    def __init__(self, step: int, signal_name: str):
        super().__init__(EXIT_PREEMPTED)
        self.step, self.signal_name = step, signal_name


class PreemptionHandler:
    """Catches the stop signals of this process (installed only from the main thread)."""

    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup] = None,
                 signals: Iterable[str] = SIGNALS):
        self.device, self.group = device, group
        self.received: Optional[int] = None  # signal number of the first stop signal
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for name in signals:
                sig = getattr(signal, name)
                self._previous[sig] = signal.signal(sig, self._on_signal)
        asked = stop_requested()  # after the handlers are in place: a signal sent meanwhile is caught
        if asked and self.received is None:
            self.received = int(getattr(signal, asked, signal.SIGUSR1))

    def _on_signal(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def should_stop(self) -> bool:
        """Collective when torch.distributed is up: True on every rank if any rank got a signal."""
        flag = torch.tensor([0 if self.received is None else int(self.received)], dtype=torch.int64, device=self.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() and self.received is None:  # another rank's signal: name it in our logs too
            self.received = int(flag.item())
        return bool(flag.item())

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


def _has_checkpoint_at(run_dir: str, step: int, is_main: bool, device: torch.device) -> bool:
    """Rank 0 decides (from the file system) and tells the others, so all ranks agree."""
    from ..checkpoint import MARKER, step_dir

    found = torch.tensor([0], dtype=torch.int64, device=device)
    if is_main:
        found[0] = int(os.path.exists(os.path.join(step_dir(run_dir, step), MARKER)))
    if dist.is_available() and dist.is_initialized():
        dist.broadcast(found, src=0)
    return bool(found.item())


def stop_if_requested(handler: PreemptionHandler, step: int, steps: int, *, run_dir: str, is_main: bool,
                      save: Callable[[], str], log: Callable[[str], None]) -> None:
    """Call on every rank after each optimizer step (``step`` of ``steps``). When a stop signal is
    pending: ``save()`` a checkpoint of this step unless ``run_dir`` already holds one, ``log`` the
    stop (``is_main``: the rank that reads the file system and logs), raise :class:`Preempted`.
    Does nothing after the last step (the run is finishing anyway)."""
    if not handler.should_stop() or step >= steps:
        return
    path = None
    if not _has_checkpoint_at(run_dir, step, is_main, handler.device):
        path = save()
    log(f"{handler.signal_name} received: stopped after step {step}/{steps}"
        f"{', checkpoint ' + path if path else ' (checkpoint already saved)'}; exit code {EXIT_PREEMPTED} "
        "(resume with resume=auto)")
    raise Preempted(step, handler.signal_name)
