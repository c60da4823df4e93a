"""moe_dist routers inside Megatron-Core's MoE layer.

:class:`MegatronRouter` takes the place of Megatron-Core's ``TopKRouter``: built with
``(config, pg_collection)``, called with ``(hidden_states [S, B, H], padding_mask)``, it
returns ``(probs [S*B, E], routing_map [S*B, E] bool)`` and attaches its auxiliary losses
to ``probs`` with Megatron's ``MoEAuxLossAutoScaler``. Inside, any router of the registry
(``moe_dist.moe.ROUTERS``) routes, and every statistic that couples tokens (load-balance
counts, Sinkhorn marginals, clustering dispersions, co-selection counts) is reduced over
the Megatron ranks that hold distinct tokens, so R ranks route exactly as one process
routes the concatenated batch. Switching a Megatron-LM model over is a spec change::

    from moe_dist.integrations.megatron import use_moe_dist_router
    spec = use_moe_dist_router(get_gpt_decoder_block_spec(config, use_transformer_engine=True),
                               router="sinkhorn")

plus two calls in the training loop: :func:`link_routers` once after the model is built
(the AC router reads the previous MoE layer's clusters) and :func:`after_optimizer_step`
after every ``optimizer.step()`` (Symphony's graph update, the step that seeds coins and
k schedules). :func:`load_checkpoint` is ``dist_checkpointing.load`` after a check that the
checkpoint is data (see docs/megatron.md).

This module never patches Megatron-Core and never calls CUDA itself; the CPU shim the
tests use lives in ``tests/helpers/megatron_shim.py``.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn

from ..errors import ConfigError, install_hint

try:
    from megatron.core import parallel_state
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler, save_to_aux_losses_tracker
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("moe_dist.integrations.megatron needs megatron-core: " + install_hint("megatron")) from exc

from ..distributed.collectives import group_size
from ..moe.routers import build_router
from ..moe.routing.layer_stats import MoEStats
from ..moe.routing.stage import RoutingStage, StageSettings
from ..moe.routing.types import RouterInputs, RoutingContext, is_recomputing
from ..safe_dcp import SafeFileSystemReader

LOAD_BALANCING_TYPES = ("aux_loss", "global_aux_loss", "none")


def _check_config(config) -> None:
    """Megatron options this router does not implement are refused, naming the option."""
    lb = config.moe_router_load_balancing_type
    if not isinstance(lb, str) or lb not in LOAD_BALANCING_TYPES:
        raise ValueError(f"moe_router_load_balancing_type={lb!r} is not supported with a moe_dist router; allowed: "
                         f"{list(LOAD_BALANCING_TYPES)} (the load-balance loss is always reduced over the ranks "
                         "holding distinct tokens)")
    if not isinstance(config.moe_aux_loss_coeff, (int, float)):
        raise ValueError(f"moe_aux_loss_coeff={config.moe_aux_loss_coeff!r} must be a single number with a moe_dist router")
    if config.moe_expert_capacity_factor is not None and config.moe_token_drop_policy != "probs":
        raise ValueError(f"moe_token_drop_policy={config.moe_token_drop_policy!r} is not supported with a moe_dist "
                         "router; allowed: ['probs'] (first-come order depends on how Megatron lays tokens out "
                         "over ranks; the lowest gates are dropped first whatever the layout)")
    unsupported = {
        "moe_pad_expert_input_to_capacity": (config.moe_pad_expert_input_to_capacity, False),
        "moe_router_enable_expert_bias": (config.moe_router_enable_expert_bias, False),
        "moe_input_jitter_eps": (config.moe_input_jitter_eps, None),
        "moe_router_force_load_balancing": (config.moe_router_force_load_balancing, False),
        "moe_enable_routing_replay": (getattr(config, "moe_enable_routing_replay", False), False),
    }
    for key, (value, default) in unsupported.items():
        if value != default:
            raise ValueError(f"{key}={value!r} is not supported with a moe_dist router; allowed: {default!r} "
                             "(moe_dist routers are dropless and choose experts themselves)")


def _set_group_limit(router_module, name: str, options: dict, config) -> None:
    """``moe_router_num_groups`` / ``moe_router_group_topk`` as ``model.moe.router_groups`` /
    ``max_groups_per_token``: the same rule as Megatron's (a group scored by the sum of its top
    ``topk // group_topk`` scores; here at least its top one), checked as moe_dist checks it."""
    from ..moe.routers.base import check_group_limit
    from ..moe.routers.registry import check_router_features, router_largest_k

    groups, max_groups = config.moe_router_num_groups, config.moe_router_group_topk
    if max_groups is None:
        raise ValueError("moe_router_num_groups is set but moe_router_group_topk is not: set both (groups chosen per token)")
    try:
        check_router_features(name, False, "fp32", group_limit=True)
        check_group_limit(config.num_moe_experts, router_largest_k(name, config.moe_router_topk, options), groups,
                          max_groups)
    except ConfigError as e:
        raise ValueError(f"moe_router_num_groups={groups}, moe_router_group_topk={max_groups}: {e}") from None
    router_module.set_group_limit(groups, max_groups)


def _distinct_token_group(config, pg_collection):
    """The ranks whose MoE-layer tokens are distinct: tensor x data x context parallel with
    sequence parallelism (each tensor-parallel rank holds a slice of the sequence), data x
    context parallel without it (tensor-parallel ranks hold the same tokens)."""
    tp = pg_collection.tp
    if config.sequence_parallel or tp is None or tp.size() == 1:
        return pg_collection.tp_dp_cp
    dp_cp = getattr(pg_collection, "dp_cp", None)
    return dp_cp if dp_cp is not None else parallel_state.get_data_parallel_group(with_context_parallel=True)


class MegatronRouter(MegatronModule):
    """A moe_dist router in Megatron-Core's router slot (``MoESubmodules.router``).

    router / router_options: a registry name and its options, as ``model.moe.router`` /
        ``model.moe.router_options`` (``moe_dist.moe.ROUTERS``); ``top_k`` is
        ``config.moe_router_topk``. seed: the run's seed (coins, layout-invariant noise).
    Loss weights come from the config: ``moe_aux_loss_coeff`` (load balance, with
    ``moe_router_load_balancing_type`` ``aux_loss`` or ``global_aux_loss``: both are reduced
    over the distinct-token ranks here; ``none`` turns it off) and ``moe_z_loss_coeff``.
    ``moe_expert_capacity_factor`` (drop policy ``probs``) drops the pairs one process would
    drop on the whole batch: the capacity comes from the global token count and the lowest
    gates over every rank's pairs go first (one host read of the ranks' pair counts).

    Attributes after a forward: ``stats`` (:class:`moe_dist.moe.MoEStats`, global values),
    ``last_routing`` (this rank's :class:`moe_dist.moe.routing.types.Routing`, tokens in Megatron's
    ``[S, B]`` order). Parameters and buffers of ``self.router`` are saved and loaded by
    Megatron's ``sharded_state_dict`` (replicated, like Megatron's own router weight).
    """

    def __init__(self, config, pg_collection=None, *, router: str = "topk", router_options: Optional[dict] = None,
                 seed: int = 0):
        super().__init__(config)
        _check_config(config)
        self.router = build_router(router, config.hidden_size, config.num_moe_experts, config.moe_router_topk,
                                   **dict(router_options or {}))
        if config.moe_router_num_groups is not None:  # group-limited routing: Megatron's options, moe_dist's rule
            _set_group_limit(self.router, router, dict(router_options or {}), config)
        if self.router.attention_needs is not None:
            raise ValueError(f"router={router!r} reads the preceding attention (its queries and keys, or its "
                             "probabilities), which Megatron-Core's MoE layer does not receive; choose another router "
                             "(e.g. 'similarity')")
        k_first, k_last = self.router.k_range
        if k_first != k_last:
            raise ValueError(f"router={router!r} with a k schedule (k_min < k_max) is not supported: Megatron's "
                             "dispatchers size their buffers by moe_router_topk")
        self.sequence_major = self.router.needs_whole_sequences
        if self.sequence_major and (config.context_parallel_size > 1 or config.sequence_parallel):
            raise ValueError(f"router={router!r} mixes tokens within a sequence and needs whole sequences on every "
                             "rank: context_parallel_size must be 1 and sequence_parallel False")
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        for p in self.router.parameters():  # tensor-parallel ranks hold distinct tokens with SP: sum their grads
            setattr(p, "sequence_parallel", config.sequence_parallel)
        self.tp_group = pg_collection.tp
        self.stats_group = _distinct_token_group(config, pg_collection)
        tp_size = pg_collection.tp.size() if pg_collection.tp is not None else 1
        # Megatron averages dense gradients over data x context parallel ranks
        self.dp_cp_size = max(1, group_size(pg_collection.tp_dp_cp) // tp_size)
        self.context = RoutingContext(stats_group=self.stats_group, ep_group=pg_collection.ep, seed=seed)
        self._settings = StageSettings(config.num_moe_experts, config.moe_router_topk, drop_policy="probs",
                                       per_rank=False)
        lb = config.moe_router_load_balancing_type
        self.aux_loss_coef = 0.0 if lb == "none" else float(config.moe_aux_loss_coeff)
        self.z_loss_coef = float(config.moe_z_loss_coeff or 0.0)
        self.layer_number: Optional[int] = None
        self._previous = None  # weak reference to the previous MoE layer's router (link_routers)
        self._micro_steps = 0  # training forwards since the last optimizer step (ctx.micro_step)
        self.stats: Optional[MoEStats] = None
        self.last_routing = None

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number
        self.context.layer_idx = layer_number - 1  # moe_dist counts blocks from 0

    # ---- forward ------------------------------------------------------------------------
    def _prev_top1(self, num_tokens: int) -> Optional[torch.Tensor]:
        prev = self._previous() if self._previous is not None else None
        routing = prev.last_routing if prev is not None else None
        if routing is None or routing.expert_ids.shape[0] != num_tokens:
            return None
        return routing.expert_ids[:, 0].detach()

    def _router_inputs(self, hidden_states: torch.Tensor,
                       padding_mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, RouterInputs]:
        """The router's rows ``[T, H]`` and what it reads besides: Megatron's ``[S, B]`` token order,
        or ``[B, S]`` sequences for the token-graph routers (``sequence_major``)."""
        S, B, H = hidden_states.shape
        real = None if padding_mask is None else ~padding_mask.reshape(S, B).bool()  # Megatron: True = padding
        prev_top1 = self._prev_top1(S * B)
        if not self.sequence_major:
            return hidden_states.reshape(S * B, H), RouterInputs(padding_mask=real, prev_top1=prev_top1)
        x = hidden_states.transpose(0, 1).reshape(B * S, H)
        if prev_top1 is not None:
            prev_top1 = prev_top1.view(S, B).t().reshape(-1)
        return x, RouterInputs(batch_shape=(B, S), padding_mask=None if real is None else real.t(), prev_top1=prev_top1)

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        S, B, H = hidden_states.shape
        ctx = self.context
        x, inputs = self._router_inputs(hidden_states, padding_mask)
        if self.training and not is_recomputing():
            ctx.micro_step = self._micro_steps
            self._micro_steps += 1
        stage = RoutingStage(self.router, ctx, self._settings)
        routing = stage.route(x, inputs)
        if self.sequence_major:
            routing = replace(routing, **{name: _to_seq_first(getattr(routing, name), B, S)
                                          for name in ("expert_ids", "gates", "probs", "logits")})
        self.last_routing = routing
        probs = routing.probs
        # the layer's routing stage with Megatron's settings: global statistics (one small all-reduce),
        # batch balance loss, global capacity dropping the lowest gates
        routed = stage.settle(routing, self.config.moe_expert_capacity_factor)
        losses, keep, tokens_g = routed.losses, routed.capacity.keep, routed.stats.total.tokens
        gates = routing.gates if keep is None else routing.gates * keep
        self.stats = routed.layer_stats

        out_probs = torch.zeros_like(probs).scatter(1, routing.expert_ids, gates)
        routing_map = torch.zeros(probs.shape, dtype=torch.bool, device=probs.device).scatter_(
            1, routing.expert_ids, True if keep is None else keep)
        if self.training and torch.is_grad_enabled() and (self.aux_loss_coef or self.z_loss_coef):
            aux = losses.weighted(self.aux_loss_coef, self.z_loss_coef)
            out_probs = MoEAuxLossAutoScaler.apply(out_probs, aux * self._aux_grad_scale(tokens_g))
            if not is_recomputing():  # a recomputed forward is not logged twice
                self._log(losses.aux_value, losses.z_value)
        return out_probs, routing_map

    def _aux_grad_scale(self, tokens_g: torch.Tensor):
        """The shares summed over the distinct-token ranks make the global loss; Megatron then
        averages gradients over data x context parallel ranks (or divides by the global token
        count with ``calculate_per_token_loss``), so the share is scaled to undo that."""
        if self.config.calculate_per_token_loss:
            return tokens_g.float()
        return float(self.dp_cp_size)

    def _log(self, aux_value: torch.Tensor, z_value: torch.Tensor) -> None:
        """Megatron's per-layer aux-loss tracker (values are global: the same on every rank)."""
        num_layers = self.config.num_layers + (self.config.mtp_num_layers or 0)
        if self.aux_loss_coef:
            save_to_aux_losses_tracker("load_balancing_loss", aux_value.float(), self.layer_number, num_layers)
        if self.z_loss_coef:
            save_to_aux_losses_tracker("z_loss", z_value.float(), self.layer_number, num_layers)

    # ---- once per optimizer step --------------------------------------------------------
    def after_optimizer_step(self) -> None:
        self.router.after_optimizer_step(self.context)
        self.context.step += 1
        self._micro_steps = 0


def _to_seq_first(t: Optional[torch.Tensor], B: int, S: int) -> Optional[torch.Tensor]:
    """Rows in ``[B, S]`` order -> ``[S, B]`` order."""
    if t is None:
        return None
    return t.reshape(B, S, *t.shape[1:]).transpose(0, 1).reshape(B * S, *t.shape[1:])


def megatron_routers(model: nn.Module) -> list[MegatronRouter]:
    """Every :class:`MegatronRouter` of ``model``, in module (layer) order."""
    return [m for m in model.modules() if isinstance(m, MegatronRouter)]


def link_routers(model: nn.Module) -> int:
    """Hand each MoE layer's router the previous one on this pipeline stage (the AC router
    clusters tokens by their top-1 expert there). Call once after building the model; returns
    the number of routers."""
    routers = megatron_routers(model)
    for prev, cur in zip([None] + routers[:-1], routers):
        cur._previous = weakref.ref(prev) if prev is not None else None
    return len(routers)


def after_optimizer_step(model: nn.Module) -> None:
    """Call on every rank after each ``optimizer.step()``: routers with per-step state update
    it (Symphony folds the co-selection counts, summed over the distinct-token ranks, into its
    graph) and the step that seeds coins and k schedules advances."""
    for router in megatron_routers(model):
        router.after_optimizer_step()


def moe_dist_router(router: str = "topk", router_options: Optional[dict] = None, seed: int = 0):
    """A router builder for ``MoESubmodules.router``: ``builder(config=..., pg_collection=...)``."""
    return functools.partial(MegatronRouter, router=router, router_options=router_options, seed=seed)


def use_moe_dist_router(spec, router: str = "topk", router_options: Optional[dict] = None, seed: int = 0):
    """A copy of a Megatron layer spec (``ModuleSpec`` of a transformer layer) or block spec
    (``TransformerBlockSubmodules``) whose MoE layers route with a moe_dist router."""
    builder = moe_dist_router(router, router_options, seed)
    if hasattr(spec, "layer_specs"):  # a block: every layer
        return replace(spec, layer_specs=[_with_router(s, builder) for s in spec.layer_specs])
    out = _with_router(spec, builder)
    if out is spec:
        raise ValueError("use_moe_dist_router: the spec has no MoE layer (its mlp submodules have no 'router'); "
                         "build it with num_experts set")
    return out


def _with_router(layer_spec, builder):
    mlp = getattr(getattr(layer_spec, "submodules", None), "mlp", None)
    if mlp is None or not hasattr(getattr(mlp, "submodules", None), "router"):
        return layer_spec  # a dense layer
    mlp = replace(mlp, submodules=replace(mlp.submodules, router=builder))
    return replace(layer_spec, submodules=replace(layer_spec.submodules, mlp=mlp))


def load_checkpoint(sharded_state_dict: dict, checkpoint_dir: str, **kwargs) -> dict:
    """``megatron.core.dist_checkpointing.load`` of a ``torch_dist`` checkpoint, after checking that
    loading it runs no code: its ``.metadata`` unpickles with the allowlist of moe_dist's own
    checkpoints, every entry is stored in the directory's own files, the entries this call loads
    as tensors (the router's state among them) are tensors, and every pickled object entry
    (Megatron-Core keeps module extra state as ``ShardedObject`` bytes, which DCP unpickles with
    ``weights_only=False``) unpickles under ``weights_only=True``. Raises
    :class:`~moe_dist.train.checkpoint.files.UnsafeCheckpoint` (one line) otherwise."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from ..errors import UnsafeCheckpoint

    reader = SafeFileSystemReader(checkpoint_dir, allow_objects=True)
    metadata = reader.read_metadata()
    tensors = {v.key for v in sharded_state_dict.values() if isinstance(v, ShardedTensor)}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata) and key in tensors:
            raise UnsafeCheckpoint(f"checkpoint {checkpoint_dir} declares entry {key!r}, a tensor of this model, as a "
                                   "pickled object; nothing was loaded")
    reader.vet_objects(metadata)
    return dist_checkpointing.load(sharded_state_dict, checkpoint_dir, **kwargs)
