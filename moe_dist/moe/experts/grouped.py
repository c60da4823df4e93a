"""Grouped feed-forward experts: one weight tensor per projection, ``[local_experts, ...]``.

The experts only compute: rows arrive grouped by local expert (``counts[i]`` rows for expert i,
in order) or laid out as segments; the dispatcher (:mod:`moe_dist.moe.dispatch`) owns every
exchange, the one overlapped with the loop kernel included (it runs the kernel's spans through
:meth:`GroupedExperts.run_spans`). Three kernels compute the same thing (``loop``:
:mod:`moe_dist.moe.experts.loop_kernel`); which is fastest depends on dtype and size on a given
machine, so ``kernel="auto"`` times them once per shape bucket and caches the winner
(:mod:`moe_dist.tuning.expert_kernel`).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...distributed.shards import local_rows
from ...checks import check_choice
from ...tuning.expert_kernel import KERNEL_TUNER, TunedExperts
from ..rows import PermuteRows, host_ints, inverse_permutation
from .loop_kernel import LoopFFN

ACTIVATIONS = ("swiglu", "gelu")
KERNELS = ("auto", "loop", "bmm", "grouped_mm")


def _contiguous_grad(t: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm's CPU backward rejects 0-stride (expanded) gradients
    if t.requires_grad:
        t.register_hook(lambda g: g.contiguous())
    return t


class GroupedExperts(nn.Module, TunedExperts):
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

    def probe(self, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> "GroupedExperts":
        """Experts of this shape with random weights, allocated directly in ``dtype`` (no fp32 copy
        first): what a rank's layer computes, timed without touching this module's own weights
        (:func:`~moe_dist.tuning.expert_kernel.agree_expert_kernels`)."""
        with torch.device("meta"):
            probe = GroupedExperts(self.num_experts, self.d_model, self.d_ff, activation=self.activation, kernel="loop")
        probe = probe.to(dtype).to_empty(device=device)  # dtype set on the meta device: nothing allocated in fp32
        with torch.no_grad():
            for w in probe.expert_parameters():
                w.copy_(torch.randn(w.shape, generator=gen, dtype=dtype, device=gen.device) * 0.02)
        return probe

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

    def _loop(self, x: torch.Tensor, counts: Sequence[int],
              segments: Optional[Sequence[tuple[int, int]]] = None) -> torch.Tensor:
        """The loop kernel on rows grouped by expert, or laid out as ``segments``."""
        return self.run_spans(LoopFFN, x, list(enumerate(counts)) if segments is None else segments)

    def run_spans(self, fn, x: torch.Tensor, layout) -> torch.Tensor:
        """``fn.apply(x, layout, w1, w3, w2)``: a loop-kernel function (:class:`LoopFFN`, or the
        dispatcher's pipelined exchange) on these experts' weights, cast once under autocast."""
        weights = (self.w1, self.w3, self.w2)
        if torch.is_autocast_enabled(x.device.type):  # cast once here, run the kernel without autocast
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weights = x.to(dtype), tuple(None if w is None else w.to(dtype) for w in weights)
            with torch.autocast(x.device.type, enabled=False):
                return fn.apply(x, layout, *weights)
        return fn.apply(x, layout, *weights)

    def cast_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` in the experts' dtype, unless autocast casts it (e.g. bf16 activations into fp32
        experts without autocast)."""
        return x if torch.is_autocast_enabled(x.device.type) else x.to(self.w1.dtype)

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

    def forward(self, x: torch.Tensor, counts: Sequence[int], segments: Optional[Sequence[tuple[int, int]]] = None,
                spans: Optional[tuple] = None) -> torch.Tensor:
        """Rows ``x`` grouped by local expert (``counts[e]`` rows each, in expert order), or laid out
        as ``segments`` (``(local expert, rows)`` in row order, an expert possibly in several).
        ``spans``: ``(fn, layout)``, a loop-kernel function the caller runs over these experts' weights
        instead (:meth:`run_spans`; the dispatcher's overlapped exchange): called through the module,
        so hooks on it (FSDP2's unsharding of the weights) run as for any forward."""
        if spans is not None:
            fn, layout = spans
            return self.run_spans(fn, self.cast_rows(x), layout)
        return self._compute(self.cast_rows(x), [int(c) for c in counts], segments)

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
