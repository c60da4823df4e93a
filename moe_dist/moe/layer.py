"""MoELayer: the routing stage -> dispatch -> experts -> combine -> shared expert.

:mod:`~moe_dist.moe.routing` (one :class:`~moe_dist.moe.routing.stage.RoutingStage`: route, the
routing statistics, balance losses, capacity; the Megatron plug-in ``moe_dist.integrations.megatron``
runs the same stage), :mod:`~moe_dist.moe.dispatch` (one dispatcher, flat or hierarchical, chosen in
:meth:`MoELayer.set_groups`: dispatch, the exchange, combine), :mod:`~moe_dist.moe.experts` (compute
only), :mod:`~moe_dist.moe.shared`; each states its host reads.

The layer is built for one process from one :class:`~moe_dist.moe.args.MoEArgs`;
``apply_expert_parallel`` (moe_dist.parallel) later keeps only this rank's experts and hands the
layer its process groups (:meth:`MoELayer.set_groups`). What its router needs
from the model for a call (sequence structure, padding, the previous MoE layer's top-1, the
attention before it: :class:`~moe_dist.moe.routing.types.RouterInputs`) is an argument of ``forward``;
``attention_needs`` says which form of the attention the router reads.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..distributed.collectives import subgroup_positions, subgroup_rows
from ..distributed.groups import ParallelGroups
from .args import MoEArgs
from .dispatch.dispatcher import DispatchCall, Dispatcher
from .dispatch.flat import FlatDispatcher
from .dispatch.hierarchical import HierarchicalDispatcher, hierarchical_fallback
from .dispatch.traffic import TrafficMeter
from .experts import GroupedExperts
from .routers import build_router
from .routers.base import nonfinite_logits_error
from .routing.layer_stats import MoEStats
from .routing.stage import RoutedCall, RoutingStage, StageSettings
from .routing.statistics import GatheredStats
from .routing.types import NO_INPUTS, Routing, RouterInputs, RoutingContext, is_recomputing
from .shared import SharedExpert, add_shared_expert, init_linear

ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


class MoELayer(nn.Module):
    """A Mixture-of-Experts feed-forward layer: input ``[..., d_model]``, output the same shape.

    After a forward pass:
      ``layer.aux_loss``: the weighted auxiliary loss to add to the task loss
          (``aux_loss_coef * load_balance + z_loss_coef * z_loss``; this rank's share, see
          ``moe_dist.moe.routing.losses``);
      ``layer.stats``: a :class:`MoEStats` (per-expert counts, drops, losses, entropy).

    Built from ``d_model`` and one :class:`~moe_dist.moe.args.MoEArgs` (``model.moe`` of a
    config; its fields say what each option does), checked once (:meth:`MoEArgs.validated`).
    ``d_ff``: the experts' hidden size when ``args.d_ff`` is None (the model's ``d_ff``).
    ``layer_idx``: the block's index (router seeds, metrics); ``init_std`` / ``out_init_std``: the
    model's initialisation recipe for the experts' input and output projections.

    The expert bias (``args.expert_bias``) is updated after each optimizer step by
    ``expert_bias_rate * sign(mean count - count)`` from the step's per-expert counts over the
    stats group (``loss_scope=global``) or this rank (``local``).
    """

    def __init__(self, d_model: int, args: MoEArgs, *, d_ff: Optional[int] = None, layer_idx: int = 0,
                 init_std: float = 0.02, out_init_std: Optional[float] = None):
        super().__init__()
        self.args = args = args.validated()
        d_ff = args.d_ff or d_ff
        if not d_ff:
            raise ValueError("MoELayer needs the experts' hidden size: args.d_ff or d_ff")
        self.d_model, self.d_ff, self.num_experts, self.top_k = d_model, d_ff, args.num_experts, args.top_k
        self.router = self._build_router()
        self.experts = GroupedExperts(args.num_experts, d_model, d_ff, activation=args.activation,
                                      kernel=args.expert_kernel, init_std=init_std, out_init_std=out_init_std)
        self.shared_expert = (SharedExpert(d_model, args.shared_d_ff, args.activation, init_std, out_init_std)
                              if args.shared_d_ff else None)
        self.shared_expert_gate = init_linear(d_model, 1, init_std) if args.shared_gate else None
        self._pending_counts: Optional[torch.Tensor] = None  # expert-bias counts of the current optimizer step
        self.groups = ParallelGroups.single()
        self.traffic = TrafficMeter()  # bytes this rank's exchanges send, intra- and inter-node
        self.dispatcher: Dispatcher = FlatDispatcher(self.num_experts, self.groups, self.traffic)
        self.context = RoutingContext(layer_idx=layer_idx)
        self.aux_loss: Optional[torch.Tensor] = None
        self.stats: Optional[MoEStats] = None
        self.last_routing: Optional[Routing] = None
        # the last forward's rows to other nodes, over several nodes: (one per pair, as the flat dispatch
        # sends them; as this layer's dispatch sent them), else None
        self.inter_node_rows: Optional[tuple[int, int]] = None
        # NaN/Inf router logits: raise (the default), or, for a trainer that skips such a step,
        # count them (global over the stats group) in nonfinite_logits and carry the NaN forward
        self.raise_on_nonfinite_logits = True
        self.nonfinite_logits = 0

    def fresh_router(self) -> nn.Module:
        """A new router like this layer's, built on the CPU from the global RNG (what
        ``moe_dist.model.init`` copies into a router that was built on the meta device)."""
        with torch.device("cpu"):
            return self._build_router()

    def _build_router(self) -> nn.Module:
        args = self.args
        router = build_router(args.router, self.d_model, args.num_experts, args.top_k, **args.router_options)
        if args.expert_bias:
            router.enable_expert_bias()
        if args.max_groups_per_token is not None:
            router.set_group_limit(args.router_groups, args.max_groups_per_token)
        router.set_compute_dtype(ROUTER_DTYPES[args.router_dtype])
        return router

    @property
    def attention_needs(self) -> Optional[str]:
        """What the router reads of the attention sub-layer before this layer: None, ``scores``
        or ``probs`` (:data:`~moe_dist.moe.routing.types.ATTENTION_NEEDS`); the model hands it over in
        ``RouterInputs.attention``."""
        return self.router.attention_needs

    @property
    def expert_bias(self) -> Optional[torch.Tensor]:
        """The aux-loss-free selection bias ``[E]`` (fp32, identical on every rank), or None."""
        return self.router.selection_bias()

    # ---- once per optimizer step (the trainer calls it on every rank) -------------------
    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        """The router's own per-step update, then the expert bias: ``b += rate * sign(mean(c) - c)``
        from the per-expert counts ``c`` of the step's training forwards. The counts are the ones the
        layer already reduced for its losses (global over the stats group, or this rank's for
        ``loss_scope=local``): no collective, no host read, the same arithmetic on every rank."""
        self.router.after_optimizer_step(self.context)
        bias = self.expert_bias
        if bias is not None and self._pending_counts is not None:
            c = self._pending_counts.to(bias.device)
            bias.add_(self.args.expert_bias_rate * torch.sign(c.mean() - c).to(bias.dtype))
        self._pending_counts = None

    def discard_step(self) -> None:
        """The optimizer step was not applied (a non-finite loss): forget its expert-bias counts."""
        self._pending_counts = None

    def take_nonfinite_logits(self) -> int:
        """The NaN/Inf router logits counted since the last call (see ``raise_on_nonfinite_logits``)."""
        bad, self.nonfinite_logits = self.nonfinite_logits, 0
        return bad

    def extra_metrics(self) -> dict:
        """Router figures and the expert bias, for metrics.jsonl (host values; call at log time)."""
        out = dict(self.router.extra_metrics())
        if self.expert_bias is not None:
            out["expert_bias"] = [float(v) for v in self.expert_bias.detach().double().cpu()]
        return out

    # ---- parallelism (applied from outside) ---------------------------------------------
    def set_groups(self, groups: ParallelGroups) -> None:
        """The one way parallelism reaches the layer (``moe_dist.parallel.apply_expert_parallel`` calls
        it): the routing statistics are gathered over ``groups.dp`` (the ranks holding distinct
        tokens), the tokens exchanged over ``groups.ep`` (hierarchically when ``groups.dispatch`` asks
        for it and the group spans several nodes, :mod:`~moe_dist.moe.dispatch.hierarchical`), by the
        dispatcher chosen here. Until then the layer runs as one process."""
        if self.num_experts % groups.ep_size:
            raise ConfigError(f"parallel.ep={groups.ep_size} must divide model.moe.num_experts={self.num_experts}")
        self.groups = groups
        self.traffic = TrafficMeter(groups.ep_nodes, groups.ep_rank)
        hierarchical = groups.dispatch == "hierarchical" and hierarchical_fallback(groups) is None
        self.dispatcher = (HierarchicalDispatcher if hierarchical else FlatDispatcher)(self.num_experts, groups,
                                                                                        self.traffic)
        self.context.stats_group, self.context.ep_group = groups.dp, groups.ep
        self._check_stand_in()

    def set_stand_in(self, routing_model) -> None:
        """A dry run's routing model (:class:`~moe_dist.moe.routing.stand_in.RoutingModel`) answers this
        layer's size-deciding host reads, whose fake tensors hold no values (None: the device does)."""
        self.context.stand_in = routing_model
        self._check_stand_in()

    def _check_stand_in(self) -> None:
        if self.context.stand_in is not None and not self.dispatcher.models_counts:
            raise ConfigError("a dry run models the flat dispatch; parallel.dispatch=hierarchical over several "
                              "nodes is not modelled (use parallel.dispatch=flat for the dry run)")

    @property
    def hierarchical(self) -> bool:
        """Whether the node-aware dispatch runs (parallel.dispatch=hierarchical over several nodes)."""
        return self.dispatcher.name == "hierarchical"

    # ---- forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, inputs: Optional[RouterInputs] = None) -> torch.Tensor:
        """``x`` ``[..., d_model]``; ``inputs``: what the router needs from the model for this call
        (None: nothing, tokens without sequence structure).

        Stages: route -> gather the routing statistics -> balance losses -> capacity -> dispatch ->
        experts -> combine -> shared expert. Host synchronisation: one read per call, the
        dispatch's (split sizes and per-expert row counts, with the global count of non-finite
        router logits riding along), plus the reads some stages state for some settings (the
        router's token layout, ``probs`` drops with global capacity on 2+ ranks). None in backward."""
        inputs = NO_INPUTS if inputs is None else inputs
        rows, n_seq = self._rows(x, inputs)
        routed = self.routing_stage(rows, inputs, self.args.capacity_factor_for(self.training), n_seq)
        self.last_routing = routed.routing
        self.aux_loss = routed.losses.weighted(self.args.aux_loss_coef, self.args.z_loss_coef)
        self._count_for_expert_bias(routed.stats)
        routed_rows, plan = self.dispatcher.dispatch(rows, routed.routing, self._dispatch_call(routed))
        self._check_nonfinite(*plan.read_along)
        out = self.dispatcher.combine(self.dispatcher.experts(self.experts, routed_rows, plan), plan, rows.shape[0])
        self.inter_node_rows = (None if plan.inter_node_pairs is None
                                else (plan.inter_node_pairs, plan.inter_node_rows))
        out = add_shared_expert(out, rows, self.shared_expert, self.shared_expert_gate)
        self.stats = routed.layer_stats
        return out.to(x.dtype).reshape(x.shape)

    @property
    def routing_stage(self) -> RoutingStage:
        """This layer's routing stage: its router, its context, ``model.moe``'s settings."""
        args = self.args
        return RoutingStage(self.router, self.context, StageSettings(
            self.num_experts, self.top_k, args.loss_scope, args.balance_loss,
            args.router_groups if args.max_groups_per_token is not None else None, args.capacity_scope,
            args.drop_policy, args.min_capacity))

    def _dispatch_call(self, routed: RoutedCall) -> DispatchCall:
        """The dispatch's per-call context: the capacity's mask, the non-finite logits and global tokens
        riding on its host read, and the expert-parallel peers' counts when known (dropless: every
        peer's counts are already in the gathered statistics, no count exchange; a dry run: modelled)."""
        stats, keep, group, ep = routed.stats, routed.capacity.keep, self.context.stats_group, self.groups.ep
        read_along = torch.stack([stats.total.nonfinite, stats.total.tokens])
        if routed.modelled_counts is not None:
            known = [routed.modelled_counts[r] for r in subgroup_positions(group, ep)]
        else:
            known = subgroup_rows(stats.per_rank.counts, group, ep) if keep is None else None
        return DispatchCall(keep, read_along, known)

    def _rows(self, x: torch.Tensor, inputs: RouterInputs) -> tuple[torch.Tensor, int]:
        """The input as rows ``[T, d_model]``, and its sequences for the sequence-level loss (0 for
        ``balance_loss=batch``): ``B`` of a ``[B, S, d]`` input, else of ``inputs.batch_shape``."""
        if x.shape[-1] != self.d_model:
            raise ValueError(f"MoELayer expects [..., {self.d_model}] input, got {tuple(x.shape)}")
        if self.args.balance_loss != "sequence":
            return x.reshape(-1, self.d_model), 0
        shape = tuple(x.shape[:-1]) if x.dim() == 3 else inputs.batch_shape
        if shape is None or len(shape) != 2 or shape[0] * shape[1] != x.numel() // self.d_model:
            raise ValueError(f"model.moe.balance_loss='sequence' needs [batch, seq, {self.d_model}] input or "
                             f"inputs.batch_shape; got input {tuple(x.shape)} and batch_shape {inputs.batch_shape}")
        return x.reshape(-1, self.d_model), int(shape[0])

    def _count_for_expert_bias(self, stats: GatheredStats) -> None:
        """Add this forward's per-expert counts to the optimizer step's (expert bias, training only)."""
        if self.expert_bias is not None and self.training and not is_recomputing():
            seen = stats.total.counts if self.args.loss_scope == "global" else stats.local.counts
            self._pending_counts = seen if self._pending_counts is None else self._pending_counts + seen

    def _check_nonfinite(self, bad: int, global_tokens: int) -> None:
        """NaN/Inf router logits (the same global count on every rank: all take the same branch, none
        waits in a collective): raise, or count them for a trainer that skips the step."""
        if not bad:
            return
        if self.raise_on_nonfinite_logits:
            raise nonfinite_logits_error(f"layer {self.context.layer_idx} router", bad, global_tokens * self.num_experts)
        self.nonfinite_logits += int(bad)  # the output holds NaN; the trainer skips the step


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


def collect_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the weighted auxiliary losses of every MoE layer's last forward pass."""
    losses = [m.aux_loss for m in moe_layers(model) if m.aux_loss is not None]
    if not losses:
        return torch.zeros((), device=next((p.device for p in model.parameters()), "cpu"))
    return torch.stack([l.float() for l in losses]).sum()


def collect_stats(model: nn.Module) -> list[Optional[MoEStats]]:
    """The last forward pass's :class:`MoEStats` of every MoE layer, in module order."""
    return [m.stats for m in moe_layers(model)]


def set_stand_in(model: nn.Module, routing_model) -> None:
    """Every MoE layer of ``model`` takes its size-deciding host reads from ``routing_model`` (a dry run,
    ``moe-dist plan --dry-run``; None: from the device again)."""
    for layer in moe_layers(model):
        layer.set_stand_in(routing_model)
