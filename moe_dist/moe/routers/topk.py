"""Softmax top-k routing: Switch (top-1, un-normalised gate), GShard / GLaM (top-2),
and Shazeer's noisy top-k."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..routing.types import Routing, RouterInputs, RoutingContext
from .base import Router, gate_normalization, fp32_linear, layout_invariant_normal
from .registry import register_router


@register_router("noisy_topk", noisy=True)
@register_router("topk")
class TopKRouter(Router):
    """Linear scores, softmax, top-k.

    normalize: renormalise the k gates to sum to one (default: yes for k > 1, no for k = 1,
        which is Switch's gate); fixed at build time from ``top_k`` (``gate_normalization``).
    noisy: Shazeer et al. (2017) noisy top-k gating: in training, add
        ``N(0, 1) * softplus(x W_noise)`` to the logits before choosing (the noise is
        layout-invariant: drawn for the global batch and sliced per rank).
    init_std: std of the router weight init.
    eval_k: experts per token in eval mode (default: top_k), to measure how a model trained at
        top_k degrades at another k (HyperRouter's SMoE baseline; ``moe-dist eval --k``). The
        gates keep the rule fixed at build time.
    """

    supports_expert_bias = supports_fp64 = supports_group_limit = has_inference_k = True
    per_expert_tensors = ("weight", "noise_weight")
    hf_exportable = True  # (the noise is a training-time addition; inference is softmax(x W) top-k)

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, normalize: bool | None = None,
                 noisy: bool = False, init_std: float = 0.02, eval_k: int | None = None):
        super().__init__(d_model, num_experts, top_k)
        self.set_eval_k(eval_k)
        self.normalize = gate_normalization(top_k, normalize)
        self.noisy = bool(noisy)
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        nn.init.normal_(self.weight, std=init_std)
        if self.noisy:
            self.noise_weight = nn.Parameter(torch.zeros(num_experts, d_model))

    @property
    def needs_token_layout(self) -> bool:  # noise must be drawn for the global batch
        return self.noisy and self.training

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        return fp32_linear(x, self.weight, dtype=self.compute_dtype)

    def route(self, x: torch.Tensor, ctx: RoutingContext, inputs: RouterInputs) -> Routing:
        logits = self.scores(x)
        if self.noisy and self.training:
            noise_std = F.softplus(fp32_linear(x, self.noise_weight, dtype=self.compute_dtype))
            eps = layout_invariant_normal((self.num_experts,), ctx, x.shape[0], salt=1, device=x.device)
            logits = logits + eps * noise_std
        probs = torch.softmax(logits, dim=-1)
        k = self.routing_k(self.top_k)
        expert_ids, gates = self.choose_topk(logits, probs, k, self.normalize)
        return Routing(expert_ids=expert_ids, gates=gates, probs=probs, logits=logits)
