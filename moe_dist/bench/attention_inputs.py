"""Synthetic attention inputs for benchmarking a router that reads the attention sub-layer
(``attention``): the layer benchmark has no model, so it makes up what a model would hand over."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..moe.routers.token_graph import ATTN_KEYS, ATTN_OUT_WEIGHT, ATTN_OUTPUT, ATTN_QUERIES, ATTN_VALUES
from ..moe.routing import RoutingContext

FORMS = ("scores", "probs")


@torch.no_grad()
def fill_attention_inputs(ctx: RoutingContext, x: torch.Tensor, heads: int = 8, kv_heads: Optional[int] = None,
                          seed: int = 0, form: str = "scores") -> None:
    """Fill ``ctx`` with the inputs of a ``heads``-head causal attention over ``x`` ``[B, S, d]``
    (``kv_heads`` key/value heads, GQA; default ``heads``) in the given ``form`` (``scores``, as
    the model hands them, or ``probs``), drawn from ``seed``; gradients flow into them as in a model."""
    B, S, D = x.shape
    dh = max(1, D // heads)
    kv_heads = heads if kv_heads is None else kv_heads
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"fill_attention_inputs: kv_heads={kv_heads} must divide heads={heads}")
    if form not in FORMS:
        raise ValueError(f"fill_attention_inputs: form={form!r}; allowed: {list(FORMS)}")
    g = torch.Generator(device=x.device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(shape, generator=g, device=x.device, dtype=torch.float32)

    q, k = rnd(B, heads, S, dh), rnd(B, kv_heads, S, dh)
    if form == "probs":
        causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
        scores = q @ k.repeat_interleave(heads // kv_heads, dim=1).transpose(-1, -2) / math.sqrt(dh)
        ctx.attn_probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1).requires_grad_()
    else:
        ctx.extras[ATTN_QUERIES] = q.to(x.dtype).requires_grad_()
        ctx.extras[ATTN_KEYS] = k.to(x.dtype).requires_grad_()
    ctx.extras[ATTN_VALUES] = (rnd(B, kv_heads, S, dh) / math.sqrt(dh)).to(x.dtype).requires_grad_()
    ctx.extras[ATTN_OUT_WEIGHT] = (rnd(D, heads * dh) / math.sqrt(heads * dh)).to(x.dtype).requires_grad_()
    ctx.extras[ATTN_OUTPUT] = rnd(B, S, D).to(x.dtype).requires_grad_()
    ctx.causal = True
