"""Bytes the expert-parallel exchange sends, to ranks on this rank's node and to other nodes.

Every transfer of an MoE layer call is recorded where it is issued, from the host split sizes it
is issued with (no device read): the forward's ``dispatch`` (routed rows out) and ``combine``
(expert outputs back), the backward's ``combine_grad`` (output gradients out) and
``dispatch_grad`` (row gradients back), and the ``counts`` exchange (``[ep, E/ep]`` int64) when the
dispatch has no peer counts (capacity mode). A forward recomputed by activation checkpointing
runs its transfers again and is recorded again: the meter counts what travels. Rows a rank
keeps for its own experts never leave it and are not counted.

    meter = TrafficMeter(groups.ep_nodes, groups.ep_rank)    # one per MoE layer
    meter.record(DISPATCH, send_splits, rows)                # where an all-to-all starts
    y = meter.on_backward(received, DISPATCH_GRAD, splits)   # its backward's send, when it runs
    meter.take()  -> Traffic(intra=..., inter=..., by_kind=...)   # and start again from zero
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch.autograd.function import once_differentiable

from ...distributed.topology import SINGLE, NodeLayout

DISPATCH, COMBINE, COMBINE_GRAD, DISPATCH_GRAD, COUNTS = "dispatch", "combine", "combine_grad", "dispatch_grad", "counts"
KINDS = (DISPATCH, COMBINE, COMBINE_GRAD, DISPATCH_GRAD, COUNTS)


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (the first dimension indexes rows) of ``t``."""
    return math.prod(t.shape[1:]) * t.element_size()


def split_bytes(nodes: NodeLayout, rank: int, splits: Sequence[int], nbytes: int) -> tuple[int, int]:
    """``(intra, inter)`` bytes of sending ``splits[r]`` rows of ``nbytes`` each to every group rank
    ``r`` from group rank ``rank``: to ranks on its node, to ranks on other nodes (none to itself)."""
    here = nodes.node_of[rank]
    intra = sum(n for r, n in enumerate(splits) if r != rank and nodes.node_of[r] == here)
    inter = sum(n for r, n in enumerate(splits) if nodes.node_of[r] != here)
    return intra * nbytes, inter * nbytes


@dataclass
class Traffic:
    """Bytes sent, ``by_kind[kind] = [intra, inter]``; ``intra`` / ``inter`` their totals."""

    by_kind: dict[str, list[int]] = field(default_factory=lambda: {k: [0, 0] for k in KINDS})

    @property
    def intra(self) -> int:
        return sum(v[0] for v in self.by_kind.values())

    @property
    def inter(self) -> int:
        return sum(v[1] for v in self.by_kind.values())

    def add(self, kind: str, intra: int, inter: int) -> None:
        v = self.by_kind[kind]
        v[0] += intra
        v[1] += inter

    def __add__(self, other: "Traffic") -> "Traffic":
        out = Traffic()
        for src in (self, other):
            for kind, (a, b) in src.by_kind.items():
                out.add(kind, a, b)
        return out


class TrafficMeter:
    """The bytes one MoE layer's transfers send from this rank over its expert-parallel group, whose
    peers sit on the nodes ``nodes`` (this rank is group rank ``rank``); host integers only."""

    def __init__(self, nodes: NodeLayout = SINGLE, rank: int = 0):
        self.nodes, self.rank = nodes, rank
        self.traffic = Traffic()

    def record(self, kind: str, splits: Sequence[int], rows: torch.Tensor) -> None:
        """A transfer of ``kind`` that sends ``splits[r]`` rows of ``rows`` to group rank ``r``."""
        self.traffic.add(kind, *split_bytes(self.nodes, self.rank, splits, row_bytes(rows)))

    def on_backward(self, t: torch.Tensor, kind: str, splits: Sequence[int]) -> torch.Tensor:
        """``t`` unchanged; when its gradient is computed (it is then sent back with ``splits``, as
        the backward of the all-to-all that produced ``t`` does), that send is recorded as ``kind``."""
        if not (torch.is_grad_enabled() and t.requires_grad):
            return t
        return _RecordGradient.apply(t, self, kind, list(splits))

    def take(self) -> Traffic:
        """What was sent since the last call."""
        out, self.traffic = self.traffic, Traffic()
        return out


class _RecordGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, meter, kind, splits):
        ctx.meter, ctx.kind, ctx.splits = meter, kind, splits
        return t.view_as(t)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        ctx.meter.record(ctx.kind, ctx.splits, grad)
        return grad, None, None, None


def take_traffic(meters: Iterable[TrafficMeter]) -> Traffic:
    """The bytes of all ``meters`` since their last take, summed (each starts again from zero)."""
    total = Traffic()
    for m in meters:
        total = total + m.take()
    return total
