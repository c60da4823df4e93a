"""The one timing helper of the choices made by timing (:mod:`moe_dist.tuning`).

Candidates run in interleaved rounds, so another process on a shared machine slows every candidate
of a round alike; round 0 warms up (its time is only a first guess), and each candidate keeps its
best time over the rounds after it, the least disturbed. On CPU the clock is this process's CPU
time, which other processes barely disturb; on accelerators, synchronised wall time.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..hardware import synchronize


def default_clock(device: torch.device) -> Callable[[], float]:
    """CPU time of this process on CPU, wall time elsewhere (around synchronisations)."""
    return time.process_time if device.type == "cpu" else time.perf_counter


def best_times(runs: dict[str, Callable[[], None]], device: torch.device, reps: int, *,
               clock: Optional[Callable[[], float]] = None, drop: Optional[float] = None,
               alternate: bool = False) -> dict[str, float]:
    """Seconds of each of ``runs`` (name -> a call that does the work once): the best of ``reps``
    interleaved rounds after a warm-up round. ``drop``: a candidate more than ``drop`` times slower
    than the best so far is not run again (it keeps its last time); ``alternate``: every other round
    runs the candidates in reverse order."""
    clock = clock or default_clock(device)
    times = dict.fromkeys(runs, float("inf"))
    for r in range(reps + 1):
        names = list(runs) if not (alternate and r % 2) else list(reversed(list(runs)))
        if drop is not None:  # decided at the start of a round, from the rounds before
            names = [n for n in names if times[n] <= drop * min(times.values())]
        for name in names:
            synchronize(device)
            t0 = clock()
            runs[name]()
            synchronize(device)
            t = clock() - t0
            times[name] = t if r <= 1 else min(times[name], t)  # round 0 only as a first guess
    return times


def slowest_over_ranks(times: dict[str, float], device: torch.device,
                       group: Optional[dist.ProcessGroup] = None) -> dict[str, float]:
    """``times`` with each value the largest over the ranks of ``group`` (default: all, when a process
    group is initialised; every rank must call this with the same names): one all-reduce, so every
    rank decides from the same numbers. A candidate is as fast as its slowest rank."""
    names = list(times)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
        return {n: times[n] for n in names}
    t = torch.tensor([times[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(names, t.tolist()))
