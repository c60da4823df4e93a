"""The shared inputs of one benchmark case: sizes, reference weights, tokens and gradients.

Every implementation of a case starts from the same expert and router weights (drawn once
from the seed, identical on every rank) and the same input tokens, so they route the same
tokens and compute the same experts; only the implementation differs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from moe_dist.moe import MoEArgs, MoELayer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Sizes:
    d_model: int = 512
    d_ff: int = 1024
    num_experts: int = 8
    top_k: int = 2
    activation: str = "swiglu"
    capacity_factor: Optional[float] = None  # None: dropless
    min_capacity: int = 0
    heads: int = 8  # attention heads of the synthetic attention handed to attention-aware routers
    kv_heads: Optional[int] = None  # key/value heads (GQA); None: as many as heads


@dataclass
class Workload:
    """One rank's tokens of a case. ``x`` is ``[B, S, d]`` when a sequence length is given
    (token-graph routers read ``RouterInputs.batch_shape``), else ``[T, d]``."""

    sizes: Sizes
    tokens: int  # per rank
    dtype: torch.dtype
    device: torch.device
    seq_len: Optional[int]
    skew: float
    seed: int
    rank: int = 0
    reference: MoELayer = field(init=False)  # fp32 topk layer whose weights every impl copies
    x: torch.Tensor = field(init=False)
    grad_out: torch.Tensor = field(init=False)
    prev_top1: torch.Tensor = field(init=False)

    def __post_init__(self):
        s = self.sizes
        if self.seq_len is not None and self.tokens % self.seq_len:
            raise ValueError(f"--seq-len {self.seq_len} must divide the token count {self.tokens}")
        torch.manual_seed(self.seed)
        self.reference = MoELayer(s.d_model, MoEArgs(d_ff=s.d_ff, num_experts=s.num_experts, top_k=s.top_k,
                                                     router="topk", activation=s.activation,
                                                     capacity_factor=s.capacity_factor, min_capacity=s.min_capacity,
                                                     expert_kernel="loop"))
        gen = torch.Generator().manual_seed(self.seed * 7919 + 1 + self.rank)
        x = torch.randn(self.tokens, s.d_model, generator=gen) + self.skew_shift()
        self.grad_out = torch.randn(self.tokens, s.d_model, generator=gen).to(self.device, self.dtype)
        self.prev_top1 = torch.randint(0, s.num_experts, (self.tokens,), generator=gen).to(self.device)
        self.x = x.to(self.device, self.dtype)
        if self.seq_len is not None:
            shape = (self.tokens // self.seq_len, self.seq_len, s.d_model)
            self.x, self.grad_out = self.x.view(shape), self.grad_out.view(shape)

    @property
    def batch_shape(self) -> tuple[int, int]:
        seq = self.seq_len or self.tokens
        return (self.tokens // seq, seq)

    def skew_shift(self) -> torch.Tensor:
        """A constant input offset ``c`` with ``W c = -skew * log(1 + e)`` for the reference
        router weight ``W [E, d]``: a Zipf-like preference with exponent ``skew`` added to every
        token's top-k router logits (expert 0 most popular), as trained routers are skewed."""
        if self.skew == 0:
            return torch.zeros(self.sizes.d_model)
        w = self.reference.router.weight.detach().double()
        bias = -self.skew * torch.log1p(torch.arange(self.sizes.num_experts, dtype=torch.float64))
        bias = bias - bias.mean()  # a common offset does not change a softmax
        return (torch.linalg.pinv(w) @ bias).float()

    def routed(self) -> tuple[torch.Tensor, list[int]]:
        """The reference router's choice for these tokens: rows of ``x`` grouped by expert
        (dropless) and the rows per expert. The floor computes its experts on exactly these."""
        x2 = self.x.reshape(-1, self.sizes.d_model)
        with torch.no_grad():
            ids = self.reference.router(x2.float().cpu(), self.reference.context).expert_ids.to(self.device)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.sizes.num_experts).tolist()
        return x2.index_select(0, order // self.sizes.top_k).contiguous(), counts


def imbalance(counts: list[int]) -> float:
    """Busiest expert's load over the mean load (1.0 = perfectly balanced)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else float("nan")


