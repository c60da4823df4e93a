"""One expert kernel for every rank of a job.

``expert_kernel: auto`` picks the fastest of the kernels that compute the experts (``loop``,
``bmm``, ``grouped_mm``) by timing them. Timed by each process on its own, the ranks of one job
can pick different kernels (their timings differ by noise and by their share of the machine) and
then compute the same layer in different ways. Here the job decides once, before its first step:

- every rank times every candidate on the same synthetic work: for each distinct expert shape of
  the model (local experts, d_model, d_ff, activation), in the compute dtype, on the rows a rank's
  experts receive per micro-batch when the load is even (``tokens per rank x top_k``), spread
  evenly over its local experts; the timing is the :class:`~moe_dist.moe.experts.KernelTuner`'s;
- the times are reduced with MAX over the ranks (a kernel is as fast as its slowest rank), in one
  all-reduce per shape;
- every rank picks from the same numbers with the same rule (``loop`` unless another kernel is
  faster by more than the tuner's margin) and fixes that kernel in its layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..moe.experts import KERNEL_TUNER, GroupedExperts, KernelTuner

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


def _auto_experts(model: nn.Module) -> dict[tuple, list[GroupedExperts]]:
    groups: dict[tuple, list[GroupedExperts]] = {}
    for m in model.modules():
        if isinstance(m, GroupedExperts) and m.kernel == "auto" and m.num_experts:
            groups.setdefault((m.num_experts, m.d_model, m.d_ff, m.activation), []).append(m)
    return groups


def _probe(experts: int, d_model: int, d_ff: int, activation: str, dtype: torch.dtype, device: torch.device,
           gen: torch.Generator) -> GroupedExperts:
    """Experts of the given shape with random weights, allocated directly in ``dtype`` (no fp32
    copy first): what a rank's layer computes, without touching the model's own weights."""
    with torch.device("meta"):
        probe = GroupedExperts(experts, d_model, d_ff, activation=activation, kernel="loop")
    probe = probe.to(dtype).to_empty(device=device)  # dtype set on the meta device: nothing allocated in fp32
    with torch.no_grad():
        for w in probe.expert_parameters():
            w.copy_(torch.randn(w.shape, generator=gen, dtype=dtype, device=gen.device) * 0.02)
    return probe


def agree_expert_kernels(model: nn.Module, rows_per_rank: int, dtype: torch.dtype, device: torch.device,
                         group: Optional[dist.ProcessGroup] = None, tuner: Optional[KernelTuner] = None,
                         seed: int = 0) -> list[KernelDecision]:
    """Decide the kernel of every ``auto`` expert module of ``model`` jointly over ``group``
    (default: all ranks, when a process group is initialised) and fix it in those modules.
    Every rank of the group must call this with the same ``rows_per_rank`` and ``dtype``, and
    the model must have the same expert shapes on every rank (as expert parallelism builds it).
    Returns one decision per distinct expert shape, in a deterministic order."""
    tuner = tuner or KERNEL_TUNER
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    decisions = []
    for shape, modules in sorted(_auto_experts(model).items(), key=lambda kv: repr(kv[0])):
        experts, d_model, d_ff, activation = shape
        times: dict = {}
        kernel = "loop"
        if rows_per_rank >= MIN_ROWS:
            gen = torch.Generator().manual_seed(seed)
            probe = _probe(experts, d_model, d_ff, activation, dtype, device, gen)
            x = torch.randn(rows_per_rank, d_model, generator=gen, device=gen.device).to(device, dtype)
            counts = [rows_per_rank // experts + (1 if i < rows_per_rank % experts else 0) for i in range(experts)]
            local = tuner.time_kernels(probe, x, counts)
            del probe, x
            names = list(local)  # the same on every rank: it depends on the dtype and sizes only
            if distributed:
                t = torch.tensor([local[k] for k in names], dtype=torch.float64, device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                local = dict(zip(names, t.tolist()))
            times = local
            kernel = tuner.pick(times)
        for m in modules:
            m.kernel = kernel
        decisions.append(KernelDecision(shape, dtype, rows_per_rank, times, kernel, len(modules)))
    return decisions
