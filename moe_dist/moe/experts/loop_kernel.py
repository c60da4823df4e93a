"""The ``loop`` expert kernel: one expert's rows at a time, with a hand-written backward.

Autograd through ``w[i]`` slices would materialise every expert's weight gradient as a full
``[E, ...]`` zero tensor plus one add per expert, and every input-gradient slice as a full
``[rows, d]`` one (O(E^2) memory traffic). Here the matmuls write straight into slices of
whole-batch buffers, and the activation (and its backward) runs block by block of
``CHUNK_ROWS`` rows right after the matmul that produced its input, while that is still in
cache, so the time per row does not grow with the batch.

The unit of work is a *span*: consecutive rows of one expert. :func:`span_forward` and
:func:`span_backward` compute one span; :class:`LoopFFN` runs the spans of one batch in row
order, and the expert-parallel exchange (:mod:`moe_dist.moe.dispatch.exchange`) runs them in the order
that overlaps its transfers. A span gives the same result whatever runs before or after it.
``w3 is None`` means a GELU MLP, else SwiGLU.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

CHUNK_ROWS = 4096  # rows per block: big enough for efficient matmuls, small enough to stay in cache

Span = tuple[int, int, int]  # (local expert, first row, end row)


def spans_of(segments: Sequence[tuple[int, int]], start: int = 0) -> list[Span]:
    """``(expert, first row, end row)`` of every non-empty segment ``(expert, rows)``, laid out in
    order from row ``start``; an expert may own several segments."""
    spans = []
    for e, c in segments:
        if c:
            spans.append((e, start, start + c))
        start += c
    return spans


def _blocks(n: int):
    for s in range(0, n, CHUNK_ROWS):
        yield s, min(s + CHUNK_ROWS, n)


def keeps_graph() -> bool:
    """Whether the running backward keeps the graph (``retain_graph=True``); True if unknown."""
    probe = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    try:
        return True if probe is None else bool(probe())
    except RuntimeError:
        return True


def span_forward(x: torch.Tensor, e: int, w1: torch.Tensor, w3: Optional[torch.Tensor], w2: torch.Tensor,
                 y: torch.Tensor) -> tuple:
    """Expert ``e`` on the rows ``x`` ``[n, d]``, written into ``y`` ``[n, d]``. Returns what the
    backward needs: ``(h1, h3, a)``, separate allocations per span (E times smaller than
    whole-batch buffers, which allocators recycle without fresh page faults)."""
    h1 = x.new_empty((x.shape[0], w1.shape[2]))
    h3 = torch.empty_like(h1) if w3 is not None else None
    a = torch.empty_like(h1)
    for s, t in _blocks(x.shape[0]):
        torch.mm(x[s:t], w1[e], out=h1[s:t])
        if w3 is not None:
            torch.mm(x[s:t], w3[e], out=h3[s:t])
            torch.mul(F.silu(h1[s:t]), h3[s:t], out=a[s:t])
        else:
            torch.ops.aten.gelu.out(h1[s:t], out=a[s:t])
        torch.mm(a[s:t], w2[e], out=y[s:t])
    return h1, h3, a


class WeightGrads:
    """The experts' weight gradients, filled span by span: an expert's first span writes its
    gradient, later spans add to it, experts without a span get zeros (:meth:`finish`)."""

    def __init__(self, w1: torch.Tensor, w3: Optional[torch.Tensor], w2: torch.Tensor, need: tuple[bool, bool, bool]):
        self.g1 = torch.empty_like(w1) if need[0] else None
        self.g3 = torch.empty_like(w3) if need[1] and w3 is not None else None
        self.g2 = torch.empty_like(w2) if need[2] else None
        self.written: set[int] = set()

    def _add(self, g: Optional[torch.Tensor], e: int, a: torch.Tensor, b: torch.Tensor) -> None:
        if g is None:
            return
        if e in self.written:
            g[e].addmm_(a, b)
        else:
            torch.mm(a, b, out=g[e])

    def add(self, e: int, x: torch.Tensor, gh1: torch.Tensor, gh3: Optional[torch.Tensor], a: torch.Tensor,
            gy: torch.Tensor) -> None:
        self._add(self.g2, e, a.t(), gy)
        self._add(self.g1, e, x.t(), gh1)
        if gh3 is not None:
            self._add(self.g3, e, x.t(), gh3)
        self.written.add(e)

    def finish(self) -> tuple:
        for g in (self.g1, self.g3, self.g2):
            if g is not None:
                for e in range(g.shape[0]):
                    if e not in self.written:
                        g[e].zero_()
        return self.g1, self.g3, self.g2


def span_backward(gy: torch.Tensor, x: torch.Tensor, acts: tuple, e: int, w1: torch.Tensor,
                  w3: Optional[torch.Tensor], w2: torch.Tensor, gx: Optional[torch.Tensor], grads: WeightGrads,
                  reuse: bool) -> None:
    """The backward of :func:`span_forward`: the rows' gradient into ``gx`` (None: not needed) and
    the expert's weight gradients into ``grads``. ``reuse``: the activations are not needed again,
    so their buffers take their gradients."""
    h1, h3, a = acts
    gh1 = h1 if reuse else torch.empty_like(h1)
    gh3 = None if h3 is None else (h3 if reuse else torch.empty_like(h3))
    for s, t in _blocks(x.shape[0]):
        ga = gy[s:t] @ w2[e].t()
        if w3 is not None:
            sh = F.silu(h1[s:t])
            ga3 = ga * h3[s:t]
            torch.ops.aten.silu_backward.grad_input(ga3, h1[s:t], grad_input=gh1[s:t])
            torch.mul(sh, ga, out=gh3[s:t])
        else:
            torch.ops.aten.gelu_backward.grad_input(ga, h1[s:t], grad_input=gh1[s:t])
        if gx is not None:
            torch.mm(gh1[s:t], w1[e].t(), out=gx[s:t])
            if w3 is not None:
                gx[s:t].addmm_(gh3[s:t], w3[e].t())
    grads.add(e, x, gh1, gh3, a, gy)


def begin_backward(ctx, gy: torch.Tensor):
    """What a loop-kernel backward starts from (:class:`LoopFFN`, the pipelined exchange): the
    saved ``x`` and weights, whether ``x`` needs a gradient, empty weight gradients, whether the
    activations may take their gradients (:func:`span_backward`'s ``reuse``) and ``gy``
    contiguous. Both save ``(x, w1, w3, w2)`` and take ``(x, layout, w1, w3, w2)``."""
    x, w1, w3, w2 = ctx.saved_tensors
    need_x, _, need_w1, need_w3, need_w2 = ctx.needs_input_grad
    grads = WeightGrads(w1, w3, w2, (need_w1, need_w3, need_w2))
    return x, (w1, w3, w2), need_x, grads, not keeps_graph(), gy.contiguous()


class LoopFFN(torch.autograd.Function):
    """The experts on rows laid out as ``segments`` (``(local expert, rows)`` in row order), one
    span after the other. Weight gradients are one matmul per span over all its rows."""

    @staticmethod
    def forward(ctx, x, segments, w1, w3, w2):
        x = x.contiguous()
        spans = spans_of(segments)
        y = x.new_empty((x.shape[0], w2.shape[2]))
        ctx.acts = [span_forward(x[s:t], e, w1, w3, w2, y[s:t]) for e, s, t in spans]
        ctx.spans = spans
        ctx.save_for_backward(x, w1, w3, w2)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        x, w, need_x, grads, reuse, gy = begin_backward(ctx, gy)
        gx = (torch.zeros_like(x) if not ctx.spans else torch.empty_like(x)) if need_x else None
        for (e, s, t), acts in zip(ctx.spans, ctx.acts):
            span_backward(gy[s:t], x[s:t], acts, e, *w, None if gx is None else gx[s:t], grads, reuse)
        if reuse:  # the graph is freed after this backward: the activations kept as attributes go with it now,
            ctx.acts = None  # not when whatever still refers to the node lets go
        g1, g3, g2 = grads.finish()
        return gx, None, g1, g3, g2
