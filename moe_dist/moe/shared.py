"""Shared experts: an always-active feed-forward block beside the routed experts
(DeepSeekMoE, Qwen2-MoE), with an optional sigmoid gate per token (Qwen2-MoE's
``shared_expert_gate``): ``out = routed(x) + sigmoid(x w_g) * shared(x)``.

Every token of a rank goes through it on that rank, so it couples no tokens across ranks; its
weights are dense weights (FSDP2-sharded or replicated with the blocks, gradients summed over
the data-parallel ranks). Its ``nn.Linear`` layers carry ``init_std`` like the model's own, so
:mod:`moe_dist.model.init` fills them layout-independently.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError


def check_shared_expert(shared_d_ff: Optional[int], shared_gate: bool) -> None:
    """The shared-expert options together: a gate needs a shared expert."""
    if shared_gate and not shared_d_ff:
        raise ConfigError("model.moe.shared_gate: true needs a shared expert; set model.moe.shared_d_ff > 0")


def init_linear(d_in: int, d_out: int, std: float) -> nn.Linear:
    layer = nn.Linear(d_in, d_out, bias=False)
    layer.init_std = std  # the recipe moe_dist.model.init follows
    nn.init.normal_(layer.weight, std=std)
    return layer


class SharedExpert(nn.Module):
    """``w2(act(w1 x) [* w3 x])``: SwiGLU (``activation="swiglu"``, as Qwen2-MoE's shared
    expert) or a GELU MLP, hidden size ``d_ff`` (the whole of the shared experts: several
    shared experts of size h are one of size n*h)."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "swiglu", init_std: float = 0.02,
                 out_init_std: Optional[float] = None):
        super().__init__()
        self.activation = activation
        self.w1 = init_linear(d_model, d_ff, init_std)
        self.w3 = init_linear(d_model, d_ff, init_std) if activation == "swiglu" else None
        self.w2 = init_linear(d_ff, d_model, init_std if out_init_std is None else out_init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.w1(x)) * self.w3(x) if self.w3 is not None else F.gelu(self.w1(x))
        return self.w2(h)


def add_shared_expert(out: torch.Tensor, x: torch.Tensor, shared_expert: Optional[SharedExpert],
                      gate: Optional[nn.Linear]) -> torch.Tensor:
    """The shared-expert stage: ``out + [sigmoid(x w_g) *] shared(x)`` (``out`` unchanged without a
    shared expert). Host synchronisation: none."""
    if shared_expert is None:
        return out
    shared = shared_expert(x)
    if gate is not None:
        shared = torch.sigmoid(gate(x)) * shared
    return out + shared.to(out.dtype)
