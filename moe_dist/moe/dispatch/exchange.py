"""Expert parallelism: routed rows travel to the ranks of their experts and their outputs back.

The dispatch lays this rank's routed rows out in *send order*: the rows for every other
expert-parallel rank first (in rank order), then the rows for this rank's own experts. Only
the first part crosses the wire, so an :class:`Exchange` can start the transfer and compute
the rows that stay here while the others travel.

With the ``loop`` kernel the exchange is a pipeline (:class:`PipelinedLoop`), forward and
backward alike:

    forward:   send rows out ........ | return outputs .......
               own rows, first half   | remote rows | own rows, second half
    backward:  send gradients out ... | return row gradients ..
               own rows, first half   | remote rows | own rows, second half

Every span of rows (one expert's rows from one source) is computed by the same kernel calls
as without the overlap (:mod:`moe_dist.moe.experts.loop_kernel`), so the outputs and row gradients
are bit-identical; only the order in which an expert's weight gradient sums its spans changes.
The other kernels exchange first, then compute (:func:`exchange_rows`, :func:`return_rows`).
:func:`experts_across` is the one entry for both: the dispatchers call it, the experts only compute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ...distributed.collective_errors import wait_collective
from ...distributed.collectives import all_to_all_rows
from ..experts.loop_kernel import CHUNK_ROWS, begin_backward, span_backward, span_forward, spans_of
from ..rows import PermuteRows
from .traffic import COMBINE, COMBINE_GRAD, DISPATCH, DISPATCH_GRAD, TrafficMeter


@dataclass
class Exchange:
    """Where the rows of one forward travel over ``group`` (this rank is ``rank`` in it).

    send: rows this rank sends to each rank (its own experts' rows: ``send[rank]``, kept here).
    recv: ``recv[src][e]`` rows that rank ``src`` sends for this rank's local expert ``e``.
    meter: records the bytes each transfer sends (:mod:`moe_dist.moe.dispatch.traffic`); None: not counted.
    runs: the rows from each ``src`` as ``(local expert, rows)`` runs in arrival order, when the rows
        of one expert from one source are several spans (the hierarchical dispatch forwards the rows
        of several origins, each its own span); None: one run per expert, ``recv[src]``.
    """

    group: Optional[dist.ProcessGroup]
    rank: int
    send: list[int]
    recv: list[list[int]]
    meter: Optional[TrafficMeter] = None
    runs: Optional[list[list[tuple[int, int]]]] = None

    def _runs(self, src: int) -> list[tuple[int, int]]:
        return list(enumerate(self.recv[src])) if self.runs is None else list(self.runs[src])

    def record(self, kind: str, splits: list[int], rows: torch.Tensor) -> None:
        """A transfer of ``kind`` sends ``splits[r]`` rows of ``rows`` to rank ``r`` (to the meter)."""
        if self.meter is not None:
            self.meter.record(kind, splits, rows)

    def on_backward(self, t: torch.Tensor, kind: str, splits: list[int]) -> torch.Tensor:
        """``t``, whose gradient the backward sends with ``splits`` (recorded as ``kind`` when it runs)."""
        return t if self.meter is None else self.meter.on_backward(t, kind, splits)

    @property
    def sent_away(self) -> int:
        """Rows that leave this rank (the leading rows of the send order)."""
        return sum(self.send) - self.send[self.rank]

    def send_splits(self) -> list[int]:
        """Rows to each rank over the wire (none to this rank)."""
        return [0 if r == self.rank else n for r, n in enumerate(self.send)]

    def recv_splits(self) -> list[int]:
        """Rows from each rank over the wire (none from this rank)."""
        return [0 if r == self.rank else sum(c) for r, c in enumerate(self.recv)]

    def remote_segments(self) -> list[tuple[int, int]]:
        """``(local expert, rows)`` of the received rows, in arrival order (by source, then expert)."""
        return [run for src in range(len(self.recv)) if src != self.rank for run in self._runs(src)]

    def own_segments(self) -> list[tuple[int, int]]:
        """``(local expert, rows)`` of the rows that stay on this rank (the tail of the send order)."""
        return self._runs(self.rank)


class _Transfer:
    """An all-to-all in flight; ``.wait()`` for it (a failure names the collective and its group,
    as a blocking one's would)."""

    def __init__(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
        self.group = group
        self.work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)

    def wait(self) -> None:
        wait_collective(self.work, "all_to_all_single", self.group)


def _start(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> _Transfer:
    """An all-to-all that runs while the caller computes."""
    return _Transfer(out, inp, out_splits, in_splits, group)


def _halves(spans: list, offset: int) -> tuple[list, list]:
    """The spans (shifted by ``offset`` rows) in two parts of about equal rows. The cut is at a
    span's end or at a block boundary inside a span (a multiple of ``CHUNK_ROWS`` from its start),
    where the kernel runs separate matmuls anyway: the outputs do not change."""
    total = sum(t - s for _, s, t in spans)
    cuts = [s + j for _, s, t in spans for j in range(CHUNK_ROWS, t - s, CHUNK_ROWS)] + [t for _, _, t in spans]
    cut = min(cuts, key=lambda c: (abs(2 * c - total), c), default=0)
    first = [(e, s + offset, min(t, cut) + offset) for e, s, t in spans if s < cut]
    second = [(e, max(s, cut) + offset, t + offset) for e, s, t in spans if t > cut]
    return first, second


class PipelinedLoop(torch.autograd.Function):
    """The loop kernel over an :class:`Exchange`: rows in send order in, their expert outputs
    in send order out, the transfers overlapped with the rows that stay on this rank."""

    @staticmethod
    def forward(ctx, x, ex: Exchange, w1, w3, w2):
        x = x.contiguous()
        away = ex.sent_away
        send, recv_splits = ex.send_splits(), ex.recv_splits()
        received = x.new_empty((sum(recv_splits), x.shape[1]))
        ex.record(DISPATCH, send, x)
        work = _start(received, x[:away], recv_splits, send, ex.group)
        own_first, own_second = _halves(spans_of(ex.own_segments()), away)
        remote = spans_of(ex.remote_segments())
        y = x.new_empty((x.shape[0], w2.shape[2]))
        y_remote = x.new_empty((received.shape[0], w2.shape[2]))
        acts = {}
        for e, s, t in own_first:
            acts[("own", s)] = span_forward(x[s:t], e, w1, w3, w2, y[s:t])
        work.wait()
        for e, s, t in remote:
            acts[("remote", s)] = span_forward(received[s:t], e, w1, w3, w2, y_remote[s:t])
        ex.record(COMBINE, recv_splits, y_remote)
        work = _start(y[:away], y_remote, send, recv_splits, ex.group)
        for e, s, t in own_second:
            acts[("own", s)] = span_forward(x[s:t], e, w1, w3, w2, y[s:t])
        work.wait()
        ctx.ex, ctx.acts, ctx.spans, ctx.received = ex, acts, (own_first, remote, own_second), received
        ctx.save_for_backward(x, w1, w3, w2)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        x, w, need_x, grads, reuse, gy = begin_backward(ctx, gy)
        ex, acts, received = ctx.ex, ctx.acts, ctx.received
        own_first, remote, own_second = ctx.spans
        away = ex.sent_away
        send, recv_splits = ex.send_splits(), ex.recv_splits()
        # every rank returns the row gradients of the rows it received, whether or not it needs its own
        gx = torch.empty_like(x) if need_x or away else x.new_empty((0, x.shape[1]))
        g_remote = gy.new_empty((received.shape[0], gy.shape[1]))
        gx_remote = torch.empty_like(received)

        def own(spans):
            for e, s, t in spans:
                span_backward(gy[s:t], x[s:t], acts[("own", s)], e, *w, gx[s:t] if need_x else None, grads, reuse)

        ex.record(COMBINE_GRAD, send, gy)
        work = _start(g_remote, gy[:away], recv_splits, send, ex.group)
        own(own_first)
        work.wait()
        for e, s, t in remote:
            span_backward(g_remote[s:t], received[s:t], acts[("remote", s)], e, *w, gx_remote[s:t], grads, reuse)
        ex.record(DISPATCH_GRAD, recv_splits, gx_remote)
        work = _start(gx[:away], gx_remote, send, recv_splits, ex.group)
        own(own_second)
        work.wait()
        if reuse:  # the graph is freed after this backward: so are the activations kept outside saved tensors
            ctx.acts = ctx.received = None
        g1, g3, g2 = grads.finish()
        return (gx if need_x else None), None, g1, g3, g2


def exchange_rows(x: torch.Tensor, ex: Exchange) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Rows in send order -> the rows this rank's experts compute: the received rows (arrival
    order), then this rank's own, with their ``(local expert, rows)`` segments (differentiable)."""
    ex.record(DISPATCH, ex.send_splits(), x)
    received = all_to_all_rows(x[:ex.sent_away], ex.recv_splits(), ex.send_splits(), ex.group)
    received = ex.on_backward(received, DISPATCH_GRAD, ex.recv_splits())
    return torch.cat([received, x[ex.sent_away:]]), ex.remote_segments() + ex.own_segments()


def return_rows(y: torch.Tensor, ex: Exchange) -> torch.Tensor:
    """The inverse of :func:`exchange_rows`: outputs in its layout -> outputs in send order."""
    arrived = sum(ex.recv_splits())
    ex.record(COMBINE, ex.recv_splits(), y)
    back = all_to_all_rows(y[:arrived], ex.send_splits(), ex.recv_splits(), ex.group)
    back = ex.on_backward(back, COMBINE_GRAD, ex.send_splits())
    return torch.cat([back, y[arrived:]])


def experts_across(experts, x: torch.Tensor, ex: Exchange, counts: list[int],
                   regroup: Optional[tuple] = None) -> torch.Tensor:
    """This rank's routed rows ``x`` in send order through the experts of their ranks (``experts``:
    this rank's :class:`~moe_dist.moe.experts.GroupedExperts`, ``counts`` rows per local expert it
    receives): the outputs come back in send order. The loop kernel overlaps the transfers with the
    rows that stay here (:class:`PipelinedLoop`); the other kernels get the exchanged rows laid out
    as the received segments, or, with ``regroup`` ``(to_flat, from_flat, segments)``, permuted into
    that layout first (the hierarchical dispatch's stage 2)."""
    if x.shape[0] != sum(ex.send):
        raise ValueError(f"the exchange sends {sum(ex.send)} rows but {x.shape[0]} were given")
    if experts.kernel == "loop" or regroup is None:
        x = experts.cast_rows(x)
    if torch.is_grad_enabled() and not x.requires_grad:
        x = x.detach().requires_grad_()  # every rank takes part in the backward exchange
    if experts.kernel == "loop":
        experts.last_kernel = "loop"
        return experts(x, counts, spans=(PipelinedLoop, ex))
    arrived, segments = exchange_rows(x, ex)
    if regroup is None:
        return return_rows(experts(arrived, counts, segments=segments), ex)
    to_flat, from_flat, flat_segments = regroup
    y = experts(PermuteRows.apply(arrived, to_flat, from_flat), counts, segments=flat_segments)
    return return_rows(PermuteRows.apply(y, from_flat, to_flat), ex)
