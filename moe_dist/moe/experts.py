"""Grouped feed-forward experts: one weight tensor per projection, ``[local_experts, ...]``.

Rows arrive grouped by local expert (``counts[i]`` rows for expert i, in order) or, with
expert parallelism, in send order with the exchange that takes them to their experts
(:mod:`moe_dist.moe.dispatch.exchange`). Three kernels compute the same thing (``loop``:
:mod:`moe_dist.moe.dispatch.loop_kernel`); which is fastest depends on dtype and size on a given
machine, so ``kernel="auto"`` times them once per shape bucket and caches the winner.
"""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed.shards import local_rows
from ..checks import check_choice
from ..hardware import synchronize
from .dispatch.exchange import Exchange, PipelinedLoop, exchange_rows, return_rows
from .dispatch.loop_kernel import LoopFFN

ACTIVATIONS = ("swiglu", "gelu")
KERNELS = ("auto", "loop", "bmm", "grouped_mm")


def host_ints(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small tensor of host integers on ``device`` without a host synchronisation: on an
    accelerator ``torch.tensor(values, device=...)`` copies from pageable memory and waits for the
    stream, so the values go through pinned memory with a non-blocking copy instead."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, device="cpu", pin_memory=True).to(device, non_blocking=True)


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm's CPU backward rejects 0-stride (expanded) gradients
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


class PermuteRows(torch.autograd.Function):
    """``x[perm]`` whose backward is the gather by the inverse permutation (autograd's
    ``index_select`` backward would zero-fill and scatter-add instead)."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class GroupedExperts(nn.Module):
    """``num_experts`` local experts of a layer whose experts ``offset .. offset+num_experts-1``
    (global indices) live on this rank.

    swiglu: ``y = (silu(x W1) * (x W3)) W2``; gelu: ``y = gelu(x W1) W2``.
    """

    def __init__(self, num_experts: int, d_model: int, d_ff: int, *, activation: str = "swiglu",
                 kernel: str = "loop", offset: int = 0, init_std: float = 0.02, out_init_std: Optional[float] = None):
        super().__init__()
        check_choice("model.moe.activation", activation, ACTIVATIONS)
        check_choice("model.moe.expert_kernel", kernel, KERNELS)
        self.num_experts, self.d_model, self.d_ff = num_experts, d_model, d_ff
        self.activation, self.kernel, self.offset = activation, kernel, offset
        self.init_std = init_std
        self.out_init_std = init_std if out_init_std is None else out_init_std
        self.w1 = nn.Parameter(torch.empty(num_experts, d_model, d_ff))
        self.w3 = nn.Parameter(torch.empty(num_experts, d_model, d_ff)) if activation == "swiglu" else None
        self.w2 = nn.Parameter(torch.empty(num_experts, d_ff, d_model))
        if not self.w1.is_meta:  # on the meta device there is nothing to fill (moe_dist.model.init does it later)
            self.reset_parameters(int(torch.randint(0, 2**31 - 1, ()).item()))

    def expert_parameters(self):
        return [p for p in (self.w1, self.w3, self.w2) if p is not None]

    def held(self, t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """``(global expert index, view)`` of every expert of ``t`` (a weight of this module, or a
        tensor shaped like one, e.g. its optimizer state) that this rank holds: all local experts,
        or, when the weights are sharded over the expert-data-parallel ranks (a DTensor), this
        rank's share: some whole experts (split on the expert dimension) or the same block of
        every local expert (split inside the experts; :meth:`within` says which block)."""
        part = local_rows(t)
        return [(self.offset + i, part.local[i - part.start]) for i in range(part.start, part.stop)]

    @staticmethod
    def within(t: torch.Tensor) -> tuple[slice, ...]:
        """The block of each held expert of ``t`` this rank holds (whole experts: full slices)."""
        return local_rows(t).within

    @torch.no_grad()
    def reset_parameters(self, base_seed: int) -> None:
        """Initialise each expert from a generator seeded by (base_seed, global expert index),
        so the values do not depend on how experts are split across ranks; a rank fills only
        the experts it holds. Split inside the experts, a rank still draws each of its experts'
        whole matrices (one at a time: a generator's draws cannot start mid-tensor) and keeps
        its block."""
        weights = [(w, std) for w, std in ((self.w1, self.init_std), (self.w3, self.init_std), (self.w2, self.out_init_std))
                   if w is not None]
        held = [(self.held(w), self.within(w)) for w, _ in weights]
        for row, (g, _) in enumerate(held[0][0]):
            gen = torch.Generator().manual_seed(base_seed * 1009 + g)
            for (w, std), (views, block) in zip(weights, held):
                whole = torch.randn(tuple(w.shape[1:]), generator=gen, device=gen.device)
                views[row][1].copy_(whole[block] * std)

    @torch.no_grad()
    def load_dense(self, w_gate: torch.Tensor, w_down: torch.Tensor, w_up: Optional[torch.Tensor] = None,
                   noise_std: float = 0.0, seed: int = 0, granularity: int = 1) -> None:
        """Initialise every local expert from a dense FFN given in ``nn.Linear`` layout
        (``w_gate, w_up: [d_ff, d_model]``, ``w_down: [d_model, d_ff]``), optionally plus noise.

        granularity ``G > 1`` (granular upcycling, arXiv 2410.07524): the dense hidden size is
        ``G * d_ff`` and global expert ``e`` gets slice ``e % G`` of it (hidden units
        ``[g*d_ff, (g+1)*d_ff)``), its down projection scaled by ``G``: top-(k*G) of whole virtual
        groups with renormalised gates then sums to the dense FFN."""
        G = int(granularity)
        if G > 1:
            if tuple(w_gate.shape) != (G * self.d_ff, self.d_model) or tuple(w_down.shape) != (self.d_model, G * self.d_ff):
                raise ValueError(f"dense FFN shapes gate {tuple(w_gate.shape)}, down {tuple(w_down.shape)} do not split "
                                 f"into {G} experts of d_ff={self.d_ff} (d_model={self.d_model})")
            if (w_up is None) != (self.w3 is None):
                raise ValueError("dense FFN and experts disagree on the activation (gated up projection present in one only)")
            gen = torch.Generator().manual_seed(seed)
            for i in range(self.num_experts):
                sl = slice((self.offset + i) % G * self.d_ff, ((self.offset + i) % G + 1) * self.d_ff)
                for w, src in ((self.w1, w_gate[sl].t()), (self.w3, None if w_up is None else w_up[sl].t()),
                               (self.w2, w_down[:, sl].t() * G)):
                    if w is not None:
                        noise = torch.randn(src.shape, generator=gen, device=gen.device) * noise_std if noise_std else 0.0
                        w[i].copy_(src.to(w.dtype) + noise)
            return
        if tuple(w_gate.shape) != (self.d_ff, self.d_model) or tuple(w_down.shape) != (self.d_model, self.d_ff):
            raise ValueError(f"dense FFN shapes gate {tuple(w_gate.shape)}, down {tuple(w_down.shape)} do not match "
                             f"experts d_model={self.d_model}, d_ff={self.d_ff}")
        if (w_up is None) != (self.w3 is None):
            raise ValueError("dense FFN and experts disagree on the activation (gated up projection present in one only)")
        gen = torch.Generator().manual_seed(seed)
        for w, src in ((self.w1, w_gate.t()), (self.w3, None if w_up is None else w_up.t()), (self.w2, w_down.t())):
            if w is None:
                continue
            for i in range(self.num_experts):
                noise = torch.randn(src.shape, generator=gen, device=gen.device) * noise_std if noise_std else 0.0
                w[i].copy_(src.to(w.dtype) + noise)

    # ---- kernels -------------------------------------------------------------------------
    def _act(self, h1: torch.Tensor, h3: Optional[torch.Tensor]) -> torch.Tensor:
        return F.silu(h1) * h3 if self.activation == "swiglu" else F.gelu(h1)

    def _loop(self, x: torch.Tensor, counts: Sequence[int], segments: Optional[Sequence[tuple[int, int]]] = None,
              exchange: Optional[Exchange] = None) -> torch.Tensor:
        """The loop kernel on rows grouped by expert, laid out as ``segments``, or in send order over
        ``exchange`` (the pipelined exchange)."""
        weights = (self.w1, self.w3, self.w2)
        if exchange is not None:
            fn, layout = PipelinedLoop, exchange
        else:
            fn, layout = LoopFFN, list(enumerate(counts)) if segments is None else segments
        if torch.is_autocast_enabled(x.device.type):  # cast once here, run the kernel without autocast
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weights = x.to(dtype), tuple(None if w is None else w.to(dtype) for w in weights)
            with torch.autocast(x.device.type, enabled=False):
                return fn.apply(x, layout, *weights)
        return fn.apply(x, layout, *weights)

    def _bmm(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        cap = max(counts) if counts else 0
        if cap == 0:
            return x.new_zeros((0, self.d_model))
        counts_t = host_ints(counts, x.device)
        starts = torch.cumsum(counts_t, 0) - counts_t
        expert_of_row = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts_t,
                                                output_size=x.shape[0])  # (a size from the host: no device read)
        slot = expert_of_row * cap + (torch.arange(x.shape[0], device=x.device) - starts[expert_of_row])
        xp = x.new_zeros((len(counts) * cap, self.d_model)).index_copy(0, slot, x).view(len(counts), cap, self.d_model)
        h = self._act(torch.bmm(xp, self.w1), torch.bmm(xp, self.w3) if self.w3 is not None else None)
        return torch.bmm(h, self.w2).view(-1, self.d_model).index_select(0, slot)

    def _grouped(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        offs = torch.cumsum(host_ints(counts, x.device, torch.int32), 0, dtype=torch.int32)
        h1 = _contiguous_grad(torch._grouped_mm(x, self.w1, offs=offs))
        h3 = _contiguous_grad(torch._grouped_mm(x, self.w3, offs=offs)) if self.w3 is not None else None
        return _contiguous_grad(torch._grouped_mm(self._act(h1, h3), self.w2, offs=offs))

    def grouped_mm_supported(self, dtype: torch.dtype) -> bool:
        """torch._grouped_mm needs 16-byte aligned strides."""
        size = torch.empty((), dtype=dtype).element_size()
        return hasattr(torch, "_grouped_mm") and (self.d_model * size) % 16 == 0 and (self.d_ff * size) % 16 == 0

    def run_kernel(self, name: str, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        if name == "loop":
            return self._loop(x, counts)
        if name == "bmm":
            return self._bmm(x, counts)
        if name == "grouped_mm":
            if not self.grouped_mm_supported(x.dtype):
                return self._loop(x, counts)  # unaligned dims: the correct fallback
            return self._grouped(x, counts)
        raise ValueError(f"unknown expert kernel {name!r}; allowed: {list(KERNELS)}")

    def forward(self, x: torch.Tensor, counts: Sequence[int], exchange: Optional[Exchange] = None,
                segments: Optional[Sequence[tuple[int, int]]] = None) -> torch.Tensor:
        """Rows ``x`` grouped by local expert (``counts[e]`` rows each, in expert order), or laid out
        as ``segments`` (``(local expert, rows)`` in row order, an expert possibly in several), or, with
        expert parallelism, this rank's routed rows in send order and the ``exchange`` that takes
        them to their experts' ranks: the outputs come back in send order. The loop kernel
        overlaps the transfers with the rows that stay here; the other kernels exchange the rows,
        group them by expert, compute, ungroup and return them."""
        counts = [int(c) for c in counts]
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.w1.dtype)  # e.g. bf16 activations into fp32 experts without autocast
        if exchange is not None:
            if x.shape[0] != sum(exchange.send):
                raise ValueError(f"the exchange sends {sum(exchange.send)} rows but {x.shape[0]} were given")
            if torch.is_grad_enabled() and not x.requires_grad:
                x = x.detach().requires_grad_()  # every rank takes part in the backward exchange
            if self.kernel == "loop":
                self.last_kernel = "loop"
                return self._loop(x, counts, exchange=exchange)
            rows, segments = exchange_rows(x, exchange)
            return return_rows(self._compute(rows, counts, segments), exchange)
        return self._compute(x, counts, segments)

    def _compute(self, x: torch.Tensor, counts: list[int],
                 segments: Optional[Sequence[tuple[int, int]]] = None) -> torch.Tensor:
        """The experts on rows grouped by expert, or laid out as ``segments`` (``(local expert,
        rows)`` in row order, an expert possibly in several): the loop kernel runs the segments
        where they are; the others group the rows first and ungroup the result."""
        if sum(counts) != x.shape[0]:
            raise ValueError(f"expert counts sum to {sum(counts)} but {x.shape[0]} rows were given")
        if segments is not None:
            segments = [(int(e), int(c)) for e, c in segments]
            if [e for e, c in segments if c] == sorted(e for e, c in segments if c):  # already grouped
                segments = None
        if x.shape[0] == 0:
            # no rows here, but stay on the autograd graph: the backward all-to-all is collective, and every
            # expert weight gets a (zero) gradient, as in a layout where these experts share a rank with busy ones
            # (AdamW decays its moments on a zero gradient but skips a parameter with none)
            if not self.num_experts:
                return x
            h = x @ self.w1[0]
            if self.w3 is not None:
                h = h * (x @ self.w3[0])
            return h @ self.w2[0]
        kernel = self.kernel if self.kernel != "auto" else KERNEL_TUNER.choose(self, x, counts)
        self.last_kernel = kernel  # what ran last (benchmarks report it)
        if segments is None:
            return self.run_kernel(kernel, x, counts)
        if kernel == "loop":
            return self._loop(x, counts, segments)
        expert_of_row = torch.repeat_interleave(host_ints([e for e, _ in segments], x.device),
                                                host_ints([c for _, c in segments], x.device),
                                                output_size=x.shape[0])
        group = torch.argsort(expert_of_row, stable=True)
        ungroup = inverse_permutation(group)
        y = self.run_kernel(kernel, PermuteRows.apply(x, group, ungroup), counts)
        return PermuteRows.apply(y, ungroup, group)


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

    def key(self, experts: GroupedExperts, x: torch.Tensor, counts: Sequence[int]) -> tuple:
        rows = max(1, x.shape[0])
        return (x.device.type, x.dtype, experts.num_experts, experts.d_model, experts.d_ff, experts.activation,
                1 << math.ceil(math.log2(rows)))

    def choose(self, experts: GroupedExperts, x: torch.Tensor, counts: Sequence[int]) -> str:
        if x.shape[0] < 256:  # too small to matter; the loop is exact and cheap
            return "loop"
        key = self.key(experts, x, counts)
        if key not in self.choices:
            self.choices[key] = self._measure(experts, x, counts)
        return self.choices[key]

    def _measure(self, experts: GroupedExperts, x: torch.Tensor, counts: Sequence[int]) -> str:
        return self.pick(self.time_kernels(experts, x, counts))

    def candidates(self, experts: GroupedExperts, dtype: torch.dtype) -> list[str]:
        """The kernels that can run these experts in ``dtype`` (``grouped_mm`` needs aligned sizes)."""
        return ["loop", "bmm"] + (["grouped_mm"] if experts.grouped_mm_supported(dtype) else [])

    def time_kernels(self, experts: GroupedExperts, x: torch.Tensor, counts: Sequence[int]) -> dict[str, float]:
        """Seconds of one forward + backward of each candidate kernel on ``x`` (best of ``reps``
        rounds after a warm-up round; a kernel ``drop`` times slower than the best so far is not
        run again and keeps its last time)."""
        candidates = self.candidates(experts, x.dtype)
        xs = x.detach().clone().requires_grad_(True)
        wrt = [xs] + [p for p in experts.expert_parameters() if p.requires_grad]
        times = dict.fromkeys(candidates, float("inf"))
        clock = self.clock or (time.process_time if xs.device.type == "cpu" else time.perf_counter)
        with torch.enable_grad():
            for r in range(self.reps + 1):  # round 0 warms up (and weeds out clear losers)
                for name in [c for c in candidates if times[c] <= self.drop * min(times.values())]:
                    synchronize(xs.device)
                    t0 = clock()
                    y = experts.run_kernel(name, xs, counts)
                    torch.autograd.grad(y, wrt, torch.ones_like(y))
                    del y
                    synchronize(xs.device)
                    t = clock() - t0
                    times[name] = t if r == 1 else min(times[name], t)  # round 0 only as a first guess
        return times

    def pick(self, times: dict[str, float]) -> str:
        """The fastest kernel, but ``loop`` unless another one is faster by more than ``margin``."""
        best = min(times, key=times.get)
        return best if times[best] < (1 - self.margin) * times["loop"] else "loop"


KERNEL_TUNER = KernelTuner()
