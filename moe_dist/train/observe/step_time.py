"""Where a training step's time goes: the loop's phases by wall clock, the step itself split by a
profiled step every ``run.time_every`` steps.

Every iteration of the loop is timed by phase on the host: ``data`` (the next batches),
``step`` (forward, backward and update), ``eval``, ``logging`` (metrics, progress, TensorBoard),
``checkpoint`` and ``other`` (the rest of the iteration). On a profiled step the ``step`` phase is
split further from the ranges the calling thread spent in (torch's profiler, CPU activity only):

- ``a2a``: waiting for the expert all-to-alls (``moe_dist::a2a``, :mod:`moe_dist.distributed.ranges`);
- ``weight_gather``: FSDP2 gathering weights before a unit's forward or backward;
- ``grad_reduce``: FSDP2 reducing gradients after a unit's backward, or replicated weights'
  gradient all-reduce;
- ``collectives``: every other collective (router statistics, the step's losses, gradient norms);
- ``optimizer``: clipping, the optimizer's update and the routers' per-step state, less the
  collectives inside it;
- ``compute``: the rest of the step (forward and backward kernels, the MoE layer's own work).

A moment counts once: where ranges nest or overlap it goes to the first of the order above. The
profiled steps also sum each op's and range's self time on that thread (:meth:`StepClock.top_ops`),
and the first ``run.time_traces`` of them can be written as Chrome traces. The
parts are what the host waited for. On a CPU with gloo that is the step's time; on a GPU the host
runs ahead of the device, and the split shows where the host blocked, not the device's timeline.
Off (``run.time_every: 0``) nothing is profiled; the host phases cost a clock read each.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import Iterable, Optional

import torch

from ...distributed.ranges import A2A, COLLECTIVE, GRAD_REDUCE, OPTIMIZER, PREFIX
from ...quiet import native_stderr_silenced
from ...safe_io import own_directory

PHASES = ("data", "step", "eval", "logging", "checkpoint", "other")
SPLIT = ("a2a", "weight_gather", "grad_reduce", "collectives", "optimizer")  # first wins an overlap
STEP_RANGE = PREFIX + "step"
TOP_OPS = 25  # ops and ranges listed in summary.json's time.top_ops_ms

_BY_NAME = {PREFIX + A2A: "a2a", PREFIX + GRAD_REDUCE: "grad_reduce", PREFIX + COLLECTIVE: "collectives",
            PREFIX + OPTIMIZER: "optimizer"}
_BY_PREFIX = (("FSDP::pre_forward", "weight_gather"), ("FSDP::pre_backward", "weight_gather"),
              ("FSDP::all_gather", "weight_gather"), ("FSDP::unshard", "weight_gather"),
              ("FSDP::post_backward", "grad_reduce"), ("FSDP::root_post_backward", "grad_reduce"),
              ("c10d::", "collectives"))


def category(name: str) -> Optional[str]:
    """The part of the step a profiler range of this name counts to (None: compute)."""
    found = _BY_NAME.get(name)
    if found:
        return found
    for prefix, part in _BY_PREFIX:
        if name.startswith(prefix):
            return part
    return None


def split_intervals(intervals: Iterable[tuple[int, int, str]], start: int, end: int) -> dict[str, float]:
    """Seconds of ``[start, end)`` (nanoseconds) in each part of :data:`SPLIT`, from ``(begin, end,
    part)`` ranges of one thread; a moment covered by several parts counts to the first in
    :data:`SPLIT`; ``compute`` is the rest."""
    rank = {part: i for i, part in enumerate(SPLIT)}
    edges: list[tuple[int, int, int]] = []  # (time, +1 open / -1 close, part)
    for b, e, part in intervals:
        b, e = max(b, start), min(e, end)
        if e > b:
            edges += [(b, 1, rank[part]), (e, -1, rank[part])]
    edges.sort()
    open_count = [0] * len(SPLIT)
    ns = [0] * len(SPLIT)
    last = None
    for t, delta, part in edges:
        if last is not None and t > last:
            active = next((i for i, c in enumerate(open_count) if c), None)
            if active is not None:
                ns[active] += t - last
        open_count[part] += delta
        last = t
    out = {part: ns[i] / 1e9 for i, part in enumerate(SPLIT)}
    out["compute"] = max(0.0, (end - start) / 1e9 - sum(out.values()))
    return out


def self_times(spans: Iterable[tuple[int, int, str]]) -> dict[str, float]:
    """Seconds of self time per name from ``(begin, end, name)`` ranges of one thread (nanoseconds;
    ranges nest, as the profiler's ops and ranges do): a range's length less its children's."""
    out: dict[str, float] = {}
    stack: list[list] = []  # [end, name, children's ns]

    def close(top) -> None:
        stack.pop()
        if stack:
            stack[-1][2] += top[3]
        out[top[1]] = out.get(top[1], 0.0) + (top[3] - top[2]) / 1e9

    for b, e, name in sorted(spans, key=lambda r: (r[0], -r[1])):
        while stack and stack[-1][0] <= b:
            close(stack[-1])
        stack.append([e, name, 0, e - b])
    while stack:
        close(stack[-1])
    return out


def split_events(events) -> Optional[tuple[dict[str, float], dict[str, float]]]:
    """A profiled step from the profiler's raw events (``name()``, ``start_ns()``, ``end_ns()``,
    ``start_thread_id()``), on the thread and in the span of the ``moe_dist::step`` range: its
    :func:`split_intervals` and the :func:`self_times` of the ops and ranges in it. None without
    that range."""
    step = next((e for e in events if e.name() == STEP_RANGE), None)
    if step is None:
        return None
    thread, start, end = step.start_thread_id(), step.start_ns(), step.end_ns()
    intervals, spans = [], []
    for e in events:
        if e.start_thread_id() != thread or e.name() == STEP_RANGE:
            continue
        b, f = e.start_ns(), e.end_ns()
        if start <= b and f <= end:
            spans.append((b, f, e.name()))
        part = category(e.name())
        if part is not None:
            intervals.append((b, f, part))
    return split_intervals(intervals, start, end), self_times(spans)


class _StepProfile:
    """torch's profiler around one step, CPU activity only, no shapes or stacks."""

    def __init__(self):
        from torch.autograd import (ProfilerActivity, ProfilerConfig, ProfilerState, _disable_profiler,
                                    _enable_profiler, _prepare_profiler)
        from torch._C._profiler import _ExperimentalConfig

        self._disable = _disable_profiler
        config = ProfilerConfig(ProfilerState.KINETO, False, False, False, False, False, _ExperimentalConfig())
        activities = {ProfilerActivity.CPU}
        with native_stderr_silenced():  # the profiler's start and stop lines
            _prepare_profiler(config, activities)
            _enable_profiler(config, activities)

    def stop(self, trace: Optional[str] = None) -> Optional[tuple[dict[str, float], dict[str, float]]]:
        """The step's split and its ops' self times (:func:`split_events`); ``trace``: also write
        the profile there as a Chrome trace (chrome://tracing, Perfetto)."""
        with native_stderr_silenced():  # the profiler's start and stop lines
            result = self._disable()
        if trace:  # written beside and renamed over (a link planted at the name is replaced, not followed)
            parent, name = os.path.split(os.path.dirname(os.path.abspath(trace)))
            directory = own_directory(parent, name)
            fd, tmp = tempfile.mkstemp(prefix=".trace.", suffix=".tmp", dir=directory)
            os.close(fd)
            result.save(tmp)
            os.replace(tmp, trace)
        return split_events(result.events())


class StepClock:
    """The loop's phases on the host, and the step split every ``every`` steps (0: never).

    ``with clock.phase("data"): ...`` adds to this iteration's phase; :meth:`iteration_done` closes
    the iteration (what was not in a phase is ``other``); :meth:`row` gives the figures of the
    iteration just measured for its metrics row; :meth:`totals` the run's sums."""

    def __init__(self, every: int):
        self.every = every
        self.totals_s = dict.fromkeys(PHASES, 0.0)
        self.split_sums = dict.fromkeys(SPLIT + ("compute",), 0.0)  # over profiled steps
        self.profiled_steps = 0
        self.profiled_step_s = 0.0
        self.op_sums: dict[str, float] = {}  # self seconds per op or range, over profiled steps
        self._current = dict.fromkeys(PHASES, 0.0)
        self._split: Optional[dict[str, float]] = None
        self._t0 = time.perf_counter()

    def due(self, step: int) -> bool:
        """Whether step number ``step`` (1-based) is split."""
        return bool(self.every) and step % self.every == 0

    def start(self) -> None:
        """The loop starts now: what came before (set-up) is no iteration's ``other``."""
        self._t0 = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str, profile: bool = False, trace: Optional[str] = None):
        """Time a phase; ``profile``: also split it (the step phase of a due step) and, with
        ``trace``, write its profile there as a Chrome trace."""
        prof = _StepProfile() if profile else None
        t0 = time.perf_counter()
        try:
            if prof is None:
                yield
            else:
                with torch.autograd.profiler.record_function(STEP_RANGE):
                    yield
        finally:
            seconds = time.perf_counter() - t0
            self._current[name] += seconds
            if prof is not None:
                found = prof.stop(trace)
                if found is not None:
                    self._split, ops = found
                    self.profiled_steps += 1
                    self.profiled_step_s += seconds
                    for part, s in self._split.items():
                        self.split_sums[part] += s
                    for op, s in ops.items():
                        self.op_sums[op] = self.op_sums.get(op, 0.0) + s

    def iteration_done(self) -> None:
        now = time.perf_counter()
        timed = sum(self._current.values())
        self._current["other"] += max(0.0, now - self._t0 - timed)
        for name, s in self._current.items():
            self.totals_s[name] += s
        self._current = dict.fromkeys(PHASES, 0.0)
        self._t0 = now

    def row(self) -> dict[str, float]:
        """The iteration so far (phases measured before its row is logged: data, step, eval) and,
        on a profiled step, the step's split: ``{"data_s": ..., "step_s": ..., "compute_s": ...}``."""
        out = {f"{name}_s": round(s, 5) for name, s in self._current.items() if name in ("data", "step", "eval")}
        if self._split is not None:
            out.update({f"{part}_s": round(s, 5) for part, s in self._split.items()})
            self._split = None
        return out

    def seconds(self, *phases: str) -> float:
        """This iteration's seconds so far in ``phases``."""
        return sum(self._current[p] for p in phases)

    def top_ops(self, n: int = TOP_OPS) -> dict[str, float]:
        """The ``n`` ops and ranges with the most self time in the profiled steps: milliseconds per
        profiled step, most first."""
        if not self.profiled_steps:
            return {}
        top = sorted(self.op_sums.items(), key=lambda kv: -kv[1])[:n]
        return {op: round(1e3 * s / self.profiled_steps, 3) for op, s in top}

    def totals(self) -> dict:
        """The run's seconds per phase, the step's seconds split in the profiled steps' proportions
        (``None`` parts when no step was profiled), how many steps were profiled and their
        :meth:`top_ops`."""
        step_total = self.totals_s["step"]
        split = {}
        if self.profiled_step_s > 0:
            split = {part: round(step_total * s / self.profiled_step_s, 3) for part, s in self.split_sums.items()}
        wall = sum(self.totals_s.values())
        return {"seconds": {k: round(v, 3) for k, v in self.totals_s.items()}, "wall_s": round(wall, 3),
                "step_split_s": split or None, "profiled_steps": self.profiled_steps,
                "top_ops_ms": self.top_ops() or None}


def time_summary(clock: StepClock, utilisation, tokens: int) -> dict:
    """summary.json's ``time``: the run's seconds per phase and the step's split
    (:meth:`StepClock.totals`), and the model FLOPs utilisation over the steps' time, against the
    peak of ``utilisation`` (:class:`~moe_dist.train.observe.mfu.Utilisation`; null when no step was
    profiled, so no peak was looked for, or when the peak is unknown)."""
    out = clock.totals()
    step_s = out["seconds"]["step"]
    mfu = utilisation.of(tokens / step_s) if utilisation.peak_known and step_s > 0 and tokens else None
    out.update(mfu=round(mfu, 5) if mfu is not None else None, peak=utilisation.peak_source or None,
               train_flops_per_token=utilisation.flops_per_token)
    return out


def describe_time(time: dict) -> str:
    """One line of the end-of-run summary: where the loop's time went, and the MFU."""
    wall = time["wall_s"] or 1.0
    phases = ", ".join(f"{name} {100 * s / wall:.0f}%" for name, s in time["seconds"].items() if s >= 0.005 * wall)
    line = f"time: {wall:.0f}s in the loop: {phases}"
    split = time["step_split_s"]
    if split:
        step = sum(split.values()) or 1.0
        parts = ", ".join(f"{part} {100 * s / step:.0f}%" for part, s in sorted(split.items(), key=lambda kv: -kv[1])
                          if s >= 0.005 * step)
        line += f"; the step ({time['profiled_steps']} profiled): {parts}"
    if time.get("mfu") is not None:
        line += f"; model FLOPs utilisation {100 * time['mfu']:.1f}% ({time['peak']})"
    return line
