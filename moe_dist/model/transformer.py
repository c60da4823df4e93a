"""Decoder-only language model whose feed-forward layers may be MoE layers.

The model is defined as for one process; parallelism reaches it from outside, afterwards:
``moe_dist.parallel.apply_expert_parallel`` keeps each MoE layer's share of the experts and hands
the layer its process groups (``MoELayer.set_groups``, the one way they reach a layer; its forward
then exchanges routing statistics and tokens over them), and the trainer shards the dense
weights. Each MoE block calls its layer with a
:class:`~moe_dist.moe.routing.types.RouterInputs`: ``batch_shape``, ``padding_mask``, ``causal``,
``prev_top1`` (top-1 experts of the previous MoE layer in this forward, handed from block to
block) and, only when the layer asks (``MoELayer.attention_needs``), the same block's attention
as the attention sub-layer returns it (:class:`~moe_dist.moe.routing.types.AttentionInputs`: queries,
keys, values, output and output projection, the fused SDPA kernel still running; and the
``[B, H, S, S]`` probabilities, computed explicitly, only for ``probs``). What the trainer owns
(``step``, ``micro_step``, ``seed``) is in each layer's ``context``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..moe import MoELayer
from ..moe.routing.types import RouterInputs
from .layers import Attention, RMSNorm, SwiGLU, rotary_tables


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``."""

    def __init__(self, cfg, idx: int, is_moe: bool):
        super().__init__()
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.idx, self.is_moe = idx, is_moe
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, cfg.init_std, out_std,
                              qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm, norm_eps=cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if is_moe:
            self.ffn = MoELayer(cfg.d_model, cfg.moe, d_ff=cfg.d_ff, layer_idx=idx, init_std=cfg.init_std,
                                out_init_std=out_std)
        else:
            self.ffn = SwiGLU(cfg.d_model, cfg.d_ff, cfg.init_std, out_std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                prev_top1: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``prev_top1``: the previous MoE layer's top-1 experts in this forward (MoE blocks hand
        it to their router)."""
        h, attention = self.attn(self.attn_norm(x), cos, sin, padding_mask,
                                 capture=self.ffn.attention_needs if self.is_moe else None)
        x = x + h
        if not self.is_moe:
            return x + self.ffn(self.ffn_norm(x))
        inputs = RouterInputs(batch_shape=(x.shape[0], x.shape[1]), padding_mask=padding_mask, causal=True,
                              prev_top1=prev_top1, attention=attention)
        return x + self.ffn(self.ffn_norm(x), inputs)


class TransformerLM(nn.Module):
    """Token ids ``[B, S]`` -> logits ``[B, S, vocab]``."""

    def __init__(self, cfg, vocab_size: int):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.moe_indices = cfg.moe.layer_indices(cfg.n_layers)
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.embed.init_std = cfg.init_std  # recipes for moe_dist.model.init (see _init_linear)
        nn.init.normal_(self.embed.weight, std=cfg.init_std)
        self.blocks = nn.ModuleList(Block(cfg, i, i in self.moe_indices) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        else:
            self.lm_head.init_std = cfg.init_std
            nn.init.normal_(self.lm_head.weight, std=cfg.init_std)
        self.head_dim = cfg.d_model // cfg.n_heads
        self.activation_checkpointing = False

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block in backward (non-reentrant ``torch.utils.checkpoint``)."""
        self.activation_checkpointing = bool(enabled)

    def forward(self, tokens: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"expected token ids [batch, seq], got shape {tuple(tokens.shape)}")
        x = self.embed(tokens)
        cos, sin = rotary_tables(tokens.shape[1], self.head_dim, self.cfg.rope_theta, tokens.device, x.dtype,
                                 self.cfg.rope_scaling)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        prev_top1 = None
        for block in self.blocks:
            if recompute:
                x = checkpoint(block, x, cos, sin, padding_mask, prev_top1, use_reentrant=False)
            else:
                x = block(x, cos, sin, padding_mask, prev_top1)
            if block.is_moe:
                prev_top1 = block.ffn.last_routing.expert_ids[:, 0].detach()
        return self.lm_head(self.norm(x))


def build_model(cfg, vocab_size: int, seed: int = 0, device="cpu") -> TransformerLM:
    """The model, its weights a function of ``seed`` alone (not of the number of processes or of
    how they split the model; see :mod:`moe_dist.model.init`), without touching the caller's
    random state.

    ``device="meta"``: built without memory and left unfilled, for code that first decides what
    each rank holds, then calls :func:`moe_dist.model.init.materialize` and
    :func:`~moe_dist.model.init.init_weights` (or loads weights)."""
    from .init import init_weights, materialize

    with torch.device("meta"), torch.random.fork_rng(devices=[]):
        model = TransformerLM(cfg, vocab_size)
    if str(device) != "meta":
        init_weights(materialize(model, device), seed)
    return model


def count_parameters(model: nn.Module) -> dict[str, int]:
    """Total parameters (each tied tensor once) and those one token uses (the k experts it is routed
    to at the end of training: ``top_k``, or a k schedule's last k)."""
    total, expert_total, active_expert = 0, 0, 0
    seen = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    for layer in [m for m in model.modules() if isinstance(m, MoELayer)]:
        n = sum(p.numel() for p in layer.experts.expert_parameters())
        per_expert = n // layer.experts.num_experts
        expert_total += per_expert * layer.num_experts
        active_expert += per_expert * layer.router.final_k
        total += per_expert * (layer.num_experts - layer.experts.num_experts)  # experts held by other ranks
    return {"total": total, "active": total - expert_total + active_expert}
