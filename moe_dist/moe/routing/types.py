"""The routing data types: the contract between routers and the rest of the MoE layer.

A router maps router inputs ``[T, d]`` to a :class:`Routing`; it never talks to the
dispatcher. Besides its input it reads two things, both arguments of its call:

- :class:`RoutingContext`, what the layer and the trainer own: the process groups
  token-coupling statistics are reduced over, the block index, the global step, micro-step
  and seed, and this rank's place in the global batch;
- :class:`RouterInputs`, what the model hands the MoE layer's forward for this call: the
  sequence structure, padding, the previous MoE layer's top-1 and, when the layer asked for
  it (``MoELayer.attention_needs``), the attention sub-layer before it (:class:`AttentionInputs`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...checks import check_choice

# the ranks a router's token-coupling statistics are reduced over (router option ``scope``):
# those holding distinct tokens, the expert-parallel group, or this rank alone
SCOPES = ("global", "ep", "local")


@dataclass
class Routing:
    """Result of routing ``T`` tokens to ``E`` experts with ``k`` choices each.

    expert_ids: ``[T, k]`` int64, the chosen experts (distinct per token).
    gates: ``[T, k]`` fp32 combine weights (carry gradient to the router).
    probs: ``[T, E]`` fp32 full distribution used for the load-balance loss and metrics.
    logits: ``[T, E]`` fp32 pre-softmax scores used for the z-loss (None: no z-loss).
    extras: router-specific values for metrics (floats or small tensors, detached).
    """

    expert_ids: torch.Tensor
    gates: torch.Tensor
    probs: torch.Tensor
    logits: Optional[torch.Tensor] = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def top_k(self) -> int:
        return self.expert_ids.shape[1]


@dataclass
class RoutingContext:
    """What the MoE layer and the trainer own that a router may read (the layer's ``context``;
    what the model hands over per call is :class:`RouterInputs`).

    stats_group: process group over the ranks that hold *distinct tokens* (data-parallel
        ranks). Statistics that couple tokens are reduced over it when a router's scope is
        ``global``. None means a single process.
    ep_group: the expert-parallel group (for routers with scope ``ep``).
    layer_idx: index of the block that owns the layer (seeds, per-layer coins).
    step: global optimizer step (k schedules, coins); micro_step: micro-batch index within it.
    seed: the run's seed.
    token_offset / global_tokens: filled in by the layer when a router needs them
        (``Router.needs_token_layout``): position of this rank's first token in the
        concatenated global batch, and its size.
    stand_in: a dry run's routing model (:class:`~moe_dist.moe.routing.stand_in.RoutingModel`): the
        host reads that size tensors take their values from it (fake tensors hold none); None otherwise.
    """

    stats_group: Optional[dist.ProcessGroup] = None
    ep_group: Optional[dist.ProcessGroup] = None
    layer_idx: int = 0
    step: int = 0
    micro_step: int = 0
    seed: int = 0
    token_offset: int = 0
    global_tokens: Optional[int] = None
    stand_in: Optional[Any] = None

    def group_for(self, scope: str) -> Optional[dist.ProcessGroup]:
        """The process group a statistic with this scope (one of :data:`SCOPES`) is reduced over."""
        check_choice("model.moe.router_options.scope", scope, SCOPES)
        return {"global": self.stats_group, "ep": self.ep_group, "local": None}[scope]


# what a router may ask of the attention sub-layer before its MoE layer (``Router.attention_needs``):
# ``scores``: the queries, keys and values, the output and the output projection (the attention keeps
# its fused kernel); ``probs``: the same and the ``[B, H, S, S]`` probabilities, computed explicitly
ATTENTION_NEEDS = ("scores", "probs")


@dataclass(frozen=True)
class AttentionInputs:
    """The attention sub-layer right before an MoE layer, as ``Attention.forward`` returns it when
    the layer asks (attention-aware routing).

    queries: ``[B, H, S, d_head]`` after the rotary embedding.
    keys, values: ``[B, H_kv, S, d_head]`` (keys after the rotary embedding; GQA: ``H_kv`` divides ``H``).
    output: ``[B, S, D]`` the sub-layer's output (after its output projection, before the residual).
    out_weight: ``[D, H * d_head]`` the output projection's weight.
    probs: ``[B, H, S, S]`` fp32 attention probabilities, only when ``probs`` were asked for.
    """

    queries: Optional[torch.Tensor] = None
    keys: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    output: Optional[torch.Tensor] = None
    out_weight: Optional[torch.Tensor] = None
    probs: Optional[torch.Tensor] = None


@dataclass(frozen=True)
class RouterInputs:
    """What the model hands an MoE layer's forward for one call, for its router.

    batch_shape: ``(B, S)`` when the tokens are ``B`` sequences of length ``S`` (token-graph
        routers and the sequence-level balance loss need the sequence structure), else None.
    padding_mask: ``[B, S]`` bool, True where a token is real (None: every token is real).
    causal: a token sees only the tokens before it (decoders); token-graph routers mix accordingly.
    prev_top1: ``[T]`` top-1 expert of each token at the previous MoE layer of this forward (AC).
    attention: the attention sub-layer before this layer, when the layer asked for it
        (``MoELayer.attention_needs``), else None.
    """

    batch_shape: Optional[tuple[int, int]] = None
    padding_mask: Optional[torch.Tensor] = None
    causal: bool = True
    prev_top1: Optional[torch.Tensor] = None
    attention: Optional[AttentionInputs] = None


NO_INPUTS = RouterInputs()  # a call with nothing from a model: tokens without sequence structure


def is_recomputing() -> bool:
    """True while autograd's backward pass is running, i.e. when a forward runs again for
    activation checkpointing. Routers with side effects (counters, EMA) skip them then."""
    return torch._C._current_graph_task_id() != -1
