"""``model.moe.expert_kernel: auto``: the expert kernel chosen by timing.

:class:`KernelTuner` times the kernels once per shape bucket in one process (what an ``auto``
expert module does lazily on its first rows); :func:`agree_expert_kernels` decides one kernel for
every rank of a job before its first step.

``expert_kernel: auto`` picks the fastest of the kernels that compute the experts (``loop``,
``bmm``, ``grouped_mm``) by timing them. Timed by each process on its own, the ranks of one job
can pick different kernels (their timings differ by noise and by their share of the machine) and
then compute the same layer in different ways. Here the job decides once, before its first step:

- every rank times every candidate on the same synthetic work: for each distinct expert shape of
  the model (local experts, d_model, d_ff, activation), in the compute dtype, on the rows a rank's
  experts receive per micro-batch when the load is even (``tokens per rank x top_k``), spread
  evenly over its local experts; the timing is the :class:`KernelTuner`'s;
- the times are reduced with MAX over the ranks (a kernel is as fast as its slowest rank), in one
  all-reduce per shape;
- every rank picks from the same numbers with the same rule (``loop`` unless another kernel is
  faster by more than the tuner's margin) and fixes that kernel in its layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from .timing import best_times, slowest_over_ranks

class TunedExperts:
    """What expert modules whose kernel is chosen here provide (a base of
    :class:`~moe_dist.moe.experts.GroupedExperts`): ``kernel`` (``auto`` until chosen), ``num_experts``,
    ``d_model``, ``d_ff``, ``activation``, and the calls the timing needs."""

    kernel: str

    def run_kernel(self, name: str, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Kernel ``name`` on rows ``x`` grouped by expert (``counts[e]`` rows each)."""
        raise NotImplementedError

    def expert_parameters(self) -> list:
        raise NotImplementedError

    def grouped_mm_supported(self, dtype: torch.dtype) -> bool:
        raise NotImplementedError

    def probe(self, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> "TunedExperts":
        """Experts of this shape with random weights in ``dtype`` (the model's own are not touched)."""
        raise NotImplementedError


class KernelTuner:
    """Times the expert kernels (forward + backward) once per shape bucket and remembers the
    fastest. The bucket is (device, dtype, experts, d_model, d_ff, activation, rows rounded up
    to a power of two).

    The kernels run on the real rows (a smaller sample favours kernels whose big temporaries
    only cost page faults at full size), in interleaved rounds (best time of ``reps`` after a
    warm-up round); a kernel more than ``drop`` times slower than the best is not run again,
    and the loop kernel is kept unless another one is faster by more than ``margin`` (noise).
    On CPU the time is this process's CPU time, which other processes on a shared machine
    barely disturb; on accelerators it is the synchronised wall time.
    """

    def __init__(self, reps: int = 2, margin: float = 0.1, drop: float = 1.5, clock=None):
        self.reps, self.margin, self.drop = reps, margin, drop
        self.clock = clock  # seconds-returning callable; default: CPU time on CPU, wall time elsewhere
        self.choices: dict[tuple, str] = {}

    def key(self, experts: TunedExperts, x: torch.Tensor, counts: Sequence[int]) -> tuple:
        rows = max(1, x.shape[0])
        return (x.device.type, x.dtype, experts.num_experts, experts.d_model, experts.d_ff, experts.activation,
                1 << math.ceil(math.log2(rows)))

    def choose(self, experts: TunedExperts, x: torch.Tensor, counts: Sequence[int]) -> str:
        if x.shape[0] < 256:  # too small to matter; the loop is exact and cheap
            return "loop"
        key = self.key(experts, x, counts)
        if key not in self.choices:
            self.choices[key] = self._measure(experts, x, counts)
        return self.choices[key]

    def _measure(self, experts: TunedExperts, x: torch.Tensor, counts: Sequence[int]) -> str:
        return self.pick(self.time_kernels(experts, x, counts))

    def candidates(self, experts: TunedExperts, dtype: torch.dtype) -> list[str]:
        """The kernels that can run these experts in ``dtype`` (``grouped_mm`` needs aligned sizes)."""
        return ["loop", "bmm"] + (["grouped_mm"] if experts.grouped_mm_supported(dtype) else [])

    def time_kernels(self, experts: TunedExperts, x: torch.Tensor, counts: Sequence[int]) -> dict[str, float]:
        """Seconds of one forward + backward of each candidate kernel on ``x`` (best of ``reps``
        rounds after a warm-up round; a kernel ``drop`` times slower than the best so far is not
        run again and keeps its last time)."""
        xs = x.detach().clone().requires_grad_(True)
        wrt = [xs] + [p for p in experts.expert_parameters() if p.requires_grad]

        def run(name: str) -> Callable[[], None]:
            def once() -> None:
                y = experts.run_kernel(name, xs, counts)
                torch.autograd.grad(y, wrt, torch.ones_like(y))
            return once

        with torch.enable_grad():
            return best_times({name: run(name) for name in self.candidates(experts, x.dtype)}, xs.device, self.reps,
                              clock=self.clock, drop=self.drop)

    def pick(self, times: dict[str, float]) -> str:
        """The fastest kernel, but ``loop`` unless another one is faster by more than ``margin``."""
        best = min(times, key=times.get)
        return best if times[best] < (1 - self.margin) * times["loop"] else "loop"


KERNEL_TUNER = KernelTuner()


MIN_ROWS = 256  # below this the kernels hardly differ; the loop is exact and cheap (as the lazy tuner)


@dataclass
class KernelDecision:
    shape: tuple  # (local experts, d_model, d_ff, activation)
    dtype: torch.dtype
    rows: int  # timed rows per rank
    times: dict  # kernel -> seconds, the maximum over the ranks (empty when not timed)
    kernel: str
    layers: int  # MoE layers that got it

    def describe(self) -> str:
        e, d, f, act = self.shape
        what = f"{self.layers} layer(s) of {e} local experts {d}x{f} {act}, {str(self.dtype).replace('torch.', '')}"
        if not self.times:
            return f"expert kernel auto -> {self.kernel} ({what}: {self.rows} rows per rank, too few to time)"
        timed = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.times.items())
        return f"expert kernel auto -> {self.kernel} ({what}, {self.rows} rows per rank; slowest rank's time: {timed})"


def _auto_experts(model: nn.Module) -> dict[tuple, list[TunedExperts]]:
    groups: dict[tuple, list[TunedExperts]] = {}
    for m in model.modules():
        if isinstance(m, TunedExperts) and m.kernel == "auto" and m.num_experts:
            groups.setdefault((m.num_experts, m.d_model, m.d_ff, m.activation), []).append(m)
    return groups


def agree_expert_kernels(model: nn.Module, rows_per_rank: int, dtype: torch.dtype, device: torch.device,
                         group: Optional[dist.ProcessGroup] = None, tuner: Optional[KernelTuner] = None,
                         seed: int = 0) -> list[KernelDecision]:
    """Decide the kernel of every ``auto`` expert module of ``model`` jointly over ``group``
    (default: all ranks, when a process group is initialised) and fix it in those modules.
    Every rank of the group must call this with the same ``rows_per_rank`` and ``dtype``, and
    the model must have the same expert shapes on every rank (as expert parallelism builds it).
    Returns one decision per distinct expert shape, in a deterministic order."""
    tuner = tuner or KERNEL_TUNER
    decisions = []
    for shape, modules in sorted(_auto_experts(model).items(), key=lambda kv: repr(kv[0])):
        experts, d_model, d_ff, activation = shape
        times: dict = {}
        kernel = "loop"
        if rows_per_rank >= MIN_ROWS:
            gen = torch.Generator().manual_seed(seed)
            probe = modules[0].probe(dtype, device, gen)
            x = torch.randn(rows_per_rank, d_model, generator=gen, device=gen.device).to(device, dtype)
            counts = [rows_per_rank // experts + (1 if i < rows_per_rank % experts else 0) for i in range(experts)]
            local = tuner.time_kernels(probe, x, counts)
            del probe, x
            # the same names on every rank: they depend on the dtype and sizes only
            times = slowest_over_ranks(local, device, group)
            kernel = tuner.pick(times)
        for m in modules:
            m.kernel = kernel
        decisions.append(KernelDecision(shape, dtype, rows_per_rank, times, kernel, len(modules)))
    return decisions
