"""The routing statistics across ranks: measured on each rank, exchanged in one small collective.

:class:`RoutingStats` names every statistic the balance losses, the capacity and the reported
:class:`~moe_dist.moe.routing.layer_stats.MoEStats` read. It travels as one float64 row per rank; the row's
layout is written once, in :data:`FIELDS`, and :meth:`RoutingStats.pack` /
:meth:`RoutingStats.unpack` are its only readers. Adding a statistic is one entry there. The group
spans, the last field, ride in the row only with node-limited routing (``2E + 6`` values without,
``3E + 6`` with).

Host synchronisation: none (the gathered statistics stay on the device).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ...distributed.collectives import all_gather_tensor, all_reduce_sum
from ..counting import count_values
from ..routers.base import count_nonfinite
from .types import Routing

# (name, width) in row order; width None = num_experts
FIELDS = (("counts", None), ("prob_sums", None), ("z_sum", 1), ("entropy_sum", 1), ("nonfinite", 1),
          ("seq_loss_sum", 1), ("sequences", 1), ("tokens", 1), ("group_spans", None))
OPTIONAL = ("group_spans",)  # the row's last fields, in it only when measured (None otherwise)


@dataclass
class RoutingStats:
    """Routing statistics, float64 on the device. Each field has shape ``[*lead, width]`` for a
    vector statistic and ``[*lead]`` for a scalar one: ``lead`` is ``()`` for one rank's (or the
    summed) values and ``(R,)`` for the values of every rank of the group.

    counts: ``[E]`` token-expert pairs routed to each expert (before capacity).
    prob_sums: ``[E]`` router probabilities summed over the tokens.
    z_sum: ``logsumexp(logits)^2`` summed over the tokens (zero without logits).
    entropy_sum: entropy of the routing distribution summed over the tokens.
    nonfinite: NaN/Inf router logits (or probabilities, without logits).
    seq_loss_sum: the sequence-level balance loss summed over the sequences (detached; zero
        without sequences). sequences: their number. tokens: tokens routed.
    group_spans: ``[E]`` with expert groups (node-limited routing): entry ``j`` counts the tokens
        whose experts lie in ``j + 1`` distinct groups; None without groups (not in the row).
    """

    counts: torch.Tensor
    prob_sums: torch.Tensor
    z_sum: torch.Tensor
    entropy_sum: torch.Tensor
    nonfinite: torch.Tensor
    seq_loss_sum: torch.Tensor
    sequences: torch.Tensor
    tokens: torch.Tensor
    group_spans: Optional[torch.Tensor] = None

    @classmethod
    @torch.no_grad()
    def measure(cls, routing: Routing, num_experts: int, seq_loss_sum: Optional[torch.Tensor] = None,
                num_sequences: int = 0, groups: Optional[int] = None) -> "RoutingStats":
        """This rank's statistics of ``routing`` (``seq_loss_sum``: the differentiable sequence-level
        loss sum over ``num_sequences`` sequences, when that loss is used; ``groups``: the number of
        contiguous expert groups whose spans per token are counted, None for none)."""
        probs, logits = routing.probs, routing.logits
        counts = count_values(routing.expert_ids, num_experts).double()
        lse = torch.logsumexp(logits, -1) if logits is not None else None
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
        return cls(counts=counts, prob_sums=probs.sum(0).double(),
                   z_sum=(lse.square().sum() if lse is not None else probs.new_zeros(())).double(),
                   entropy_sum=entropy.sum().double(),
                   nonfinite=count_nonfinite(logits if logits is not None else probs).double(),
                   seq_loss_sum=(seq_loss_sum.detach().double() if num_sequences else counts.new_zeros(())),
                   sequences=counts.new_full((), num_sequences), tokens=counts.new_full((), routing.expert_ids.shape[0]),
                   group_spans=group_spans(routing.expert_ids, num_experts, groups).double() if groups else None)

    def pack(self) -> torch.Tensor:
        """The statistics as one row ``[2E + 6]``, ``[3E + 6]`` with group spans (the collective's
        payload)."""
        return torch.cat([getattr(self, name).reshape(-1) for name, _ in FIELDS if getattr(self, name) is not None])

    @classmethod
    def unpack(cls, rows: torch.Tensor, num_experts: int) -> "RoutingStats":
        """The inverse of :meth:`pack` for ``[..., 2E + 6]`` or ``[..., 3E + 6]`` rows (fields are
        views of ``rows``; the row's length says whether it carries group spans)."""
        out, pos = {}, 0
        for name, width in FIELDS:
            n = num_experts if width is None else width
            if name in OPTIONAL and pos == rows.shape[-1]:
                break
            out[name] = rows[..., pos:pos + n] if width is None else rows[..., pos]
            pos += n
        assert pos == rows.shape[-1], f"a row of {rows.shape[-1]} values, {pos} expected"
        return cls(**out)

    @property
    def num_experts(self) -> int:
        return self.counts.shape[-1]


def group_spans(expert_ids: torch.Tensor, num_experts: int, groups: int) -> torch.Tensor:
    """``[E]`` int64: entry ``j`` counts the tokens (rows of ``expert_ids [T, k]``) whose experts lie in
    ``j + 1`` distinct groups of ``num_experts / groups`` contiguous experts. No host read."""
    group_of = expert_ids // (num_experts // groups)
    present = torch.zeros(expert_ids.shape[0], groups, dtype=torch.long, device=expert_ids.device)
    spans = present.scatter_(1, group_of, 1).sum(-1)
    return count_values((spans - 1).clamp_min(0), num_experts)


@dataclass
class GatheredStats:
    """The statistics over the stats group: ``total`` summed over its ranks, ``per_rank`` each
    rank's (``[R, ...]`` fields, in group rank order; None when only the sum was reduced) and
    ``local`` this rank's own."""

    total: RoutingStats
    per_rank: Optional[RoutingStats]
    local: RoutingStats

    @property
    def ranks(self) -> int:
        return 1 if self.per_rank is None else self.per_rank.tokens.shape[0]


def gather_routing_stats(local: RoutingStats, group: Optional[dist.ProcessGroup]) -> GatheredStats:
    """Every rank's statistics: one all-gather of the packed rows over ``group``."""
    rows = all_gather_tensor(local.pack(), group)  # [R, 2E + 6] (3E + 6 with group spans)
    E = local.num_experts
    return GatheredStats(total=RoutingStats.unpack(rows.sum(0), E), per_rank=RoutingStats.unpack(rows, E), local=local)


def reduce_routing_stats(local: RoutingStats, group: Optional[dist.ProcessGroup]) -> GatheredStats:
    """The statistics summed over ``group`` (one all-reduce; no per-rank values)."""
    return GatheredStats(total=RoutingStats.unpack(all_reduce_sum(local.pack(), group), local.num_experts),
                         per_rank=None, local=local)
