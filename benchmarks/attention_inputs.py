"""Synthetic attention inputs for benchmarking a router that reads the attention sub-layer
(``attention``): the layer benchmark has no model, so it makes up what a model would hand over."""
from __future__ import annotations

import math
from typing import Optional

import torch

from moe_dist.moe.routing.types import ATTENTION_NEEDS, AttentionInputs


@torch.no_grad()
def synthetic_attention_inputs(x: torch.Tensor, heads: int = 8, kv_heads: Optional[int] = None, seed: int = 0,
                               form: str = "scores") -> AttentionInputs:
    """What a ``heads``-head causal attention over ``x`` ``[B, S, d]`` (``kv_heads`` key/value heads,
    GQA; default ``heads``) hands a router in the given ``form`` (``scores``, as the model hands
    them, or ``probs``), drawn from ``seed``; leaf tensors, so gradients flow into them as in a model."""
    B, S, D = x.shape
    dh = max(1, D // heads)
    kv_heads = heads if kv_heads is None else kv_heads
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"synthetic_attention_inputs: kv_heads={kv_heads} must divide heads={heads}")
    if form not in ATTENTION_NEEDS:
        raise ValueError(f"synthetic_attention_inputs: form={form!r}; allowed: {list(ATTENTION_NEEDS)}")
    g = torch.Generator(device=x.device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(shape, generator=g, device=x.device, dtype=torch.float32)

    q, k = rnd(B, heads, S, dh), rnd(B, kv_heads, S, dh)
    queries = keys = probs = None
    if form == "probs":
        causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
        scores = q @ k.repeat_interleave(heads // kv_heads, dim=1).transpose(-1, -2) / math.sqrt(dh)
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1).requires_grad_()
    else:
        queries, keys = q.to(x.dtype).requires_grad_(), k.to(x.dtype).requires_grad_()
    values = (rnd(B, kv_heads, S, dh) / math.sqrt(dh)).to(x.dtype).requires_grad_()
    out_weight = (rnd(D, heads * dh) / math.sqrt(heads * dh)).to(x.dtype).requires_grad_()
    output = rnd(B, S, D).to(x.dtype).requires_grad_()
    return AttentionInputs(queries=queries, keys=keys, values=values, output=output, out_weight=out_weight, probs=probs)
