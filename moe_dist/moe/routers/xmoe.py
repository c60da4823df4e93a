"""X-MoE routing (Chi et al., 2022): scores are cosine similarities in a low-dimensional
space between projected tokens and L2-normalised expert embeddings, over a learnable
temperature. Keeps routing from collapsing onto the hidden states' dominant directions."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..routing.types import Routing, RouterInputs, RoutingContext
from .base import Router, gate_normalization, fp32_linear
from .registry import register_router
from ...errors import ConfigError


@register_router("xmoe")
class XMoERouter(Router):
    """dim: routing dimension (paper: 16). init_temperature: initial tau (learned in log space,
    clamped to [min_temperature, 1])."""

    supports_expert_bias = supports_fp64 = supports_group_limit = True
    per_expert_tensors = ("expert_embed",)

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, dim: int = 16,
                 init_temperature: float = 0.07, min_temperature: float = 0.01,
                 normalize: bool | None = None, init_std: float = 0.02):
        super().__init__(d_model, num_experts, top_k)
        if dim < 1:
            raise ConfigError(f"model.moe.router_options.dim must be >= 1, got {dim}")
        if not 0 < init_temperature:
            raise ConfigError(f"model.moe.router_options.init_temperature must be > 0, got {init_temperature}")
        self.normalize = gate_normalization(top_k, normalize)
        self.min_temperature = min_temperature
        self.proj = nn.Parameter(torch.empty(dim, d_model))
        nn.init.normal_(self.proj, std=init_std)
        self.expert_embed = nn.Parameter(torch.empty(num_experts, dim))
        nn.init.orthogonal_(self.expert_embed) if num_experts <= dim else nn.init.normal_(self.expert_embed, std=0.32)
        self.log_temperature = nn.Parameter(torch.full((1,), math.log(init_temperature)))  # 1-d: FSDP2 cannot shard 0-d

    def temperature(self) -> torch.Tensor:
        return self.log_temperature.float().exp().clamp(self.min_temperature, 1.0)

    def route(self, x: torch.Tensor, ctx: RoutingContext, inputs: RouterInputs) -> Routing:
        with torch.autocast(device_type=x.device.type, enabled=False):
            z = F.normalize(fp32_linear(x, self.proj, dtype=self.compute_dtype), dim=-1)
            e = F.normalize(self.expert_embed.to(self.compute_dtype), dim=-1)
            logits = (z @ e.t()) / self.temperature().to(self.compute_dtype)
        probs = torch.softmax(logits, dim=-1)
        expert_ids, gates = self.choose_topk(logits, probs, self.top_k, self.normalize)
        return Routing(expert_ids=expert_ids, gates=gates, probs=probs, logits=logits,
                       extras={"temperature": self.temperature().detach()})
