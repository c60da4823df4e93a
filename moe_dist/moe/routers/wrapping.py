"""Routers that reshape the expert probabilities of an inner *base* router.

The token-graph routers (Similarity / Attention-aware) and Symphony do not score tokens
themselves: a base router (``topk``, ``noisy_topk``, ``xmoe``, ...) supplies the full
probability vector, and the wrapping router mixes it before choosing the top-k.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..routing.types import Routing, RouterInputs, RoutingContext
from .base import Router
from .registry import ROUTERS, build_router
from ...checks import check_choice


class WrappingRouter(Router):
    """Builds ``self.base`` from the registry; forwards the base's token-layout need and hooks.

    base: registry name of the router that supplies the probabilities (not a wrapping one).
    base_options: that router's options (its ``top_k`` is this router's; a mapping, which the
        registry checks with the other options).
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, base: str, base_options: Optional[dict]):
        super().__init__(d_model, num_experts, top_k)
        check_choice("model.moe.router_options.base", base,
                     sorted(n for n, cls in ROUTERS.items() if not issubclass(cls, WrappingRouter)))
        self.base = build_router(base, d_model, num_experts, top_k, **(base_options or {}))
        self.base_name = base

    @property
    def scorer(self) -> nn.Module:
        return self.base

    @property
    def needs_token_layout(self) -> bool:  # e.g. noisy_topk draws layout-invariant noise
        return self.base.needs_token_layout

    def base_routing(self, x: torch.Tensor, ctx: RoutingContext, inputs: RouterInputs) -> Routing:
        return self.base(x, ctx, inputs)

    def after_optimizer_step(self, ctx: RoutingContext) -> None:
        self.base.after_optimizer_step(ctx)

    def extra_metrics(self) -> dict:
        return {f"base_{k}": v for k, v in self.base.extra_metrics().items()}


def topk_set_changed(ids_a: torch.Tensor, ids_b: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool: whether two ``[T, k]`` expert choices differ as sets (order ignored)."""
    return (ids_a.sort(-1).values != ids_b.sort(-1).values).any(-1)
