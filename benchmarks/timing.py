"""Timing and peak-memory measurement that works on CPU and accelerators alike."""
from __future__ import annotations

import json
import os
import resource
import statistics
import tempfile
import time
from typing import Callable, Optional, Sequence

import torch

from moe_dist.hardware import synchronize


def timed(fn: Callable[[], None], device: torch.device) -> tuple[float, float, int]:
    """(wall seconds, process CPU seconds, minor page faults) of one call of ``fn``, queued
    device work included.

    The CPU time is a second view on a loaded machine: other processes stretch the wall
    time but not (much) the CPU time this process used. Page faults show fresh memory
    being touched (see :mod:`benchmarks.allocator`).
    """
    synchronize(device)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    synchronize(device)
    t1, c1 = time.perf_counter(), time.process_time()
    return t1 - t0, c1 - c0, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def peak_step_memory(fn: Callable[[], None], device: torch.device) -> int:
    """Bytes allocated at the peak of one call of ``fn`` beyond what was live before it.

    Accelerators report it through their allocator statistics. The CPU allocator keeps no
    statistics, so there the call runs once under the profiler with memory tracking and the
    peak of its running allocation total is read from the trace.
    """
    if device.type != "cpu":
        synchronize(device)
        torch.accelerator.reset_peak_memory_stats(device)
        before = torch.accelerator.memory_allocated(device)
        fn()
        synchronize(device)
        return int(torch.accelerator.max_memory_allocated(device) - before)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    mem = [e["args"] for e in events if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0]
    if not mem:
        return 0
    # "Total Allocated" is the running total after each event; before the first one it was
    # the first total minus that event's (signed) size
    base = mem[0]["Total Allocated"] - mem[0]["Bytes"]
    return int(max(m["Total Allocated"] for m in mem) - base)


LOAD_SLACK = 0.5  # load average above the benchmark's own processes that still counts as idle


def busy_note(procs: int, when: str) -> Optional[str]:
    """One line when the 1-minute load average exceeds the ``procs`` processes a benchmark runs (and
    :data:`LOAD_SLACK`): another program shares the cores, and the figures are not an idle machine's
    (a single busy thread beside a 2-core run can double a step's time). None when idle."""
    load = os.getloadavg()[0]
    if load <= procs + LOAD_SLACK:
        return None
    return (f"note: load average {load:.2f} {when} exceeds the {procs} process(es) this benchmark runs: another "
            "program competes for the cores; these figures are not from an idle machine")


def say_if_busy(procs: int, when: str) -> None:
    """Print :func:`busy_note`'s line, if any."""
    busy = busy_note(procs, when)
    if busy:
        print(busy, flush=True)
