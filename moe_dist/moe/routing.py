"""The contract between routers and the rest of the MoE layer.

A router maps router inputs ``[T, d]`` to a :class:`Routing`; it never talks to the
dispatcher. Anything a router needs beyond its input (process group for token-coupling
statistics, the global step, the previous MoE layer's top-1, attention probabilities)
comes from the :class:`RoutingContext` that the owning layer hands it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..checks import check_choice

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
    """Per-layer, per-call context a router may read.

    stats_group: process group over the ranks that hold *distinct tokens* (data-parallel
        ranks). Statistics that couple tokens are reduced over it when a router's scope is
        ``global``. None means a single process.
    ep_group: the expert-parallel group (for routers with scope ``ep``).
    layer_idx: index of the block that owns the layer (seeds, per-layer coins).
    step: global optimizer step (k schedules, coins); micro_step: micro-batch index within it.
    seed: the run's seed.
    batch_shape: ``(B, S)`` when the tokens are ``B`` sequences of length ``S`` (token-graph
        routers need the sequence structure), else None.
    padding_mask: ``[B, S]`` bool, True where a token is real (optional).
    prev_top1: ``[T]`` top-1 expert of each token at the previous MoE layer (AC router).
    attn_probs: attention probabilities of the attention just before this layer, when the
        router asked for them (``Router.needs_attention``).
    token_offset / global_tokens: filled in by the layer when a router needs them
        (``Router.needs_token_layout``): position of this rank's first token in the
        concatenated global batch, and its size.
    """

    stats_group: Optional[dist.ProcessGroup] = None
    ep_group: Optional[dist.ProcessGroup] = None
    layer_idx: int = 0
    step: int = 0
    micro_step: int = 0
    seed: int = 0
    batch_shape: Optional[tuple[int, int]] = None
    padding_mask: Optional[torch.Tensor] = None
    prev_top1: Optional[torch.Tensor] = None
    attn_probs: Optional[torch.Tensor] = None
    token_offset: int = 0
    global_tokens: Optional[int] = None
    causal: bool = True
    extras: dict[str, Any] = field(default_factory=dict)

    def group_for(self, scope: str) -> Optional[dist.ProcessGroup]:
        """The process group a statistic with this scope (one of :data:`SCOPES`) is reduced over."""
        check_choice("model.moe.router_options.scope", scope, SCOPES)
        return {"global": self.stats_group, "ep": self.ep_group, "local": None}[scope]


def is_recomputing() -> bool:
    """True while autograd's backward pass is running, i.e. when a forward runs again for
    activation checkpointing. Routers with side effects (counters, EMA) skip them then."""
    return torch._C._current_graph_task_id() != -1
