"""The routing stage: route -> gather the routing statistics -> balance losses -> capacity -> the
layer's statistics, once per forward, the same for :class:`~moe_dist.moe.layer.MoELayer` and the
Megatron plug-in (``moe_dist.integrations.megatron``).

Each step lives in its own module of this package (:mod:`.statistics`, :mod:`.losses`,
:mod:`.capacity`, :mod:`.layer_stats`); each states its host reads. Under a dry run the layer's
:class:`~moe_dist.moe.routing.types.RoutingContext` carries the routing model that stands in for
the size-deciding device reads (:mod:`.stand_in`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ...distributed.collectives import all_gather_tensor, group_rank, group_size
from .capacity import CapacityDecision, apply_capacity
from .layer_stats import MoEStats
from .losses import BalanceLosses, balance_losses, sequence_balance_sum
from .stand_in import LayerCall, kept_counts
from .statistics import GatheredStats, RoutingStats, gather_routing_stats, reduce_routing_stats
from .types import Routing, RouterInputs, RoutingContext


def token_layout(num_tokens: int, group: Optional[dist.ProcessGroup], device,
                 modelled: bool = False) -> tuple[int, int]:
    """(this rank's first token in the concatenated global batch, global tokens): one all-gather
    of the ranks' token counts over ``group``, read to the host once (``modelled``, a dry run:
    every rank holds ``num_tokens``)."""
    if modelled:
        return group_rank(group) * num_tokens, group_size(group) * num_tokens
    sizes = all_gather_tensor(torch.full((1,), num_tokens, device=device), group).view(-1).tolist()
    return sum(sizes[: group_rank(group)]), sum(sizes)


def route(router, x: torch.Tensor, ctx: RoutingContext, inputs: RouterInputs) -> Routing:
    """``router`` on the rows ``x`` ``[T, d]``. Host synchronisation: one read of the ranks' token
    counts for a router with ``needs_token_layout`` (:func:`token_layout`), plus whatever the router
    itself reads (Sinkhorn: its stop test)."""
    if router.needs_token_layout:
        ctx.token_offset, ctx.global_tokens = token_layout(x.shape[0], ctx.stats_group, x.device,
                                                           ctx.stand_in is not None)
    return router(x, ctx, inputs)


@dataclass(frozen=True)
class StageSettings:
    """How the stage reduces, weighs and caps (``model.moe`` of a config, :class:`~moe_dist.moe.args.MoEArgs`).

    per_rank: gather every rank's statistics (``loss_scope=local``, position capacity, the dispatch's
        peer counts use them) rather than only their sum; router_groups: count the expert groups a
        token spans (group-limited routing), else None."""

    num_experts: int
    top_k: int
    loss_scope: str = "global"
    balance_loss: str = "batch"
    router_groups: Optional[int] = None
    capacity_scope: str = "global"
    drop_policy: str = "position"
    min_capacity: int = 0
    per_rank: bool = True


@dataclass
class RoutedCall:
    """What one forward's routing stage gives the layer: this rank's ``routing``, the statistics over
    the stats group, the balance losses, the capacity's decision and the layer's statistics; with a
    dry run's stand-in, ``modelled_counts`` ``[R][E]``: the kept pairs per expert of every rank of the
    stats group (else None)."""

    routing: Routing
    stats: GatheredStats
    losses: BalanceLosses
    capacity: CapacityDecision
    layer_stats: MoEStats
    modelled_counts: Optional[list[list[int]]] = None


class RoutingStage:
    """``router`` with the statistics, losses and capacity that couple its tokens across the ranks of
    ``context.stats_group``. :meth:`route` then :meth:`settle` (the Megatron plug-in reorders the
    routing between the two); :meth:`__call__` runs both."""

    def __init__(self, router, context: RoutingContext, settings: StageSettings):
        self.router, self.context, self.settings = router, context, settings

    def route(self, rows: torch.Tensor, inputs: RouterInputs) -> Routing:
        return route(self.router, rows, self.context, inputs)

    def settle(self, routing: Routing, capacity_factor: Optional[float], num_sequences: int = 0) -> RoutedCall:
        """Statistics (one all-gather, or one all-reduce without ``per_rank``), losses, capacity and the
        layer's statistics of ``routing``; ``num_sequences``: the sequences of a sequence-level balance
        loss (``balance_loss=sequence``)."""
        s, group = self.settings, self.context.stats_group
        seq_loss = (sequence_balance_sum(routing.probs, routing.expert_ids, num_sequences)
                    if s.balance_loss == "sequence" else None)
        measured = RoutingStats.measure(routing, s.num_experts, seq_loss, num_sequences, s.router_groups)
        stats = (gather_routing_stats if s.per_rank else reduce_routing_stats)(measured, group)
        losses = balance_losses(routing, stats, s.loss_scope, s.balance_loss, seq_loss, num_sequences)
        modelled = self.context.stand_in is not None
        capacity = apply_capacity(routing, stats, capacity_factor, scope=s.capacity_scope, drop_policy=s.drop_policy,
                                  min_capacity=s.min_capacity, group=group, modelled=modelled)
        layer_stats = MoEStats.of(stats.total, losses, capacity, routing, s.router_groups is not None)
        counts = self._modelled_counts(routing, capacity_factor) if modelled else None
        return RoutedCall(routing, stats, losses, capacity, layer_stats, counts)

    def __call__(self, rows: torch.Tensor, inputs: RouterInputs, capacity_factor: Optional[float],
                 num_sequences: int = 0) -> RoutedCall:
        return self.settle(self.route(rows, inputs), capacity_factor, num_sequences)

    def _modelled_counts(self, routing: Routing, capacity_factor: Optional[float]) -> list[list[int]]:
        """The kept pairs per expert of every rank of the stats group (``[R][E]``) from the dry run's
        routing model, capped as :func:`~.capacity.apply_capacity` caps them."""
        s, group = self.settings, self.context.stats_group
        call = LayerCall(self.context.layer_idx, routing.expert_ids.shape[0], s.top_k, s.num_experts,
                         group_size(group), group_rank(group), capacity_factor, s.capacity_scope, s.drop_policy,
                         s.min_capacity)
        return kept_counts(self.context.stand_in.routed(call), call)
