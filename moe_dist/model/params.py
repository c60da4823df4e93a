"""Exact parameter counts of our decoder from its config, without building it.

The formulae follow moe_dist.model (RMSNorm weights, GQA projections, optional q/k/v
biases and q/k norms, SwiGLU FFN / experts, tied or separate output projection); a router's parameters are
counted by instantiating that router alone (they are tiny: about E x d). "active" = what one
token uses: every dense weight and the top-k experts of each MoE layer (for a router with a k
schedule, the k training ends with). These are the figures a published model card quotes
(e.g. Mixtral-8x7B: 46.7B total, 12.9B active).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class BlockShape:
    """The sizes of one block, for counting and for activation memory."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int  # dense FFN hidden size
    expert_d_ff: int
    num_experts: int
    top_k: int
    gated: bool  # SwiGLU experts (3 matrices) or GELU (2)
    shared_d_ff: int = 0  # hidden size of the always-active shared expert of an MoE layer (0: none)
    shared_gate: bool = False
    qk_norm: bool = False  # RMSNorm over the whole query and key projections (OLMoE)


def block_shape(model_cfg) -> BlockShape:
    m = model_cfg
    return BlockShape(d_model=m.d_model, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads or m.n_heads,
                      head_dim=m.d_model // m.n_heads, d_ff=m.d_ff, expert_d_ff=m.moe.d_ff or m.d_ff,
                      num_experts=m.moe.num_experts, top_k=m.moe.top_k, gated=m.moe.activation == "swiglu",
                      shared_d_ff=m.moe.shared_d_ff or 0, shared_gate=bool(m.moe.shared_gate and m.moe.shared_d_ff),
                      qk_norm=m.qk_norm == "projection")


def _meta_router(model_cfg):
    from ..moe.routers import build_router
    import torch

    m = model_cfg.moe
    with torch.device("meta"):  # shapes only, no memory
        return build_router(m.router, model_cfg.d_model, m.num_experts, m.top_k, **m.router_options)


def count_params(model_cfg, moe_blocks: Optional[list[int]] = None) -> dict:
    """``{"total", "active", "embedding", "attention", "dense_ffn", "experts", "routers", "per_expert",
    "moe_layers", ...}`` for ``model_cfg`` (moe_dist.config.ModelConfig). ``moe_blocks``:
    the MoE block indices (default: from ``model.moe.layers``; ``[]`` = a dense model)."""
    m = model_cfg
    s = block_shape(m)
    if moe_blocks is None:
        moe_blocks = m.moe.layer_indices(m.n_layers)
    n_moe = len(moe_blocks)
    n_dense = m.n_layers - n_moe
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    attn = s.d_model * q + 2 * s.d_model * kv + q * s.d_model + ((q + 2 * kv) if m.qkv_bias else 0)
    attn += (q + kv) if m.qk_norm == "projection" else 0  # q/k RMSNorm weights
    norms = 2 * s.d_model
    dense_ffn = 3 * s.d_model * s.d_ff
    per_expert = (3 if s.gated else 2) * s.d_model * s.expert_d_ff
    meta_router = _meta_router(m) if n_moe else None
    router = sum(p.numel() for p in meta_router.parameters()) if n_moe else 0
    shared_expert = (3 if s.gated else 2) * s.d_model * s.shared_d_ff + (s.d_model if s.shared_gate else 0)
    embedding = m.vocab_size * s.d_model
    head = 0 if m.tie_embeddings else m.vocab_size * s.d_model
    shared = (embedding + head + s.d_model + m.n_layers * (attn + norms) + n_dense * dense_ffn
              + n_moe * (router + shared_expert))
    experts_total = n_moe * s.num_experts * per_expert
    experts_active = n_moe * (meta_router.final_k if n_moe else 0) * per_expert  # a k schedule's last k
    return {
        "total": shared + experts_total, "active": shared + experts_active,
        "embedding": embedding, "lm_head": head, "attention": m.n_layers * attn, "norms": m.n_layers * norms + s.d_model,
        "dense_ffn": n_dense * dense_ffn, "experts": experts_total, "routers": n_moe * router,
        "shared_experts": n_moe * shared_expert,
        "per_expert": per_expert, "moe_layers": n_moe, "dense_layers": n_dense,
        "largest_dense_block": attn + norms + max(dense_ffn if n_dense else 0, (router + shared_expert) if n_moe else 0),
        "dense_params": shared,  # everything but the experts: replicated or FSDP-sharded over data ranks
    }


def flops_per_token(counts: dict, d_model: int, vocab_size: int, seq_len: int, n_layers: int,
                    top_k: int) -> dict[str, float]:
    """Forward FLOPs of one token: ``expert`` (one MoE layer's ``k`` experts) and ``other`` (every
    matmul outside the experts, the output head and causal attention's scores and mixing included)."""
    dense_matmuls = counts["attention"] + counts["dense_ffn"] + counts["routers"] + counts["shared_experts"]
    scores = 2 * seq_len * d_model * n_layers  # QK^T and PV, 2 x 2 S d each, halved by the causal mask
    return {"expert": 2.0 * top_k * counts["per_expert"],
            "other": 2.0 * (dense_matmuls + vocab_size * d_model) + scores}


def train_flops_per_token(model_cfg, seq_len: int, moe_blocks: Optional[list[int]] = None) -> float:
    """Model FLOPs of training on one token: the forward's (:func:`flops_per_token`, every MoE layer's
    k experts) and the backward's (twice the forward). A recomputed forward (activation
    checkpointing) is not counted: model FLOPs utilisation counts the model's work, not the run's."""
    m = model_cfg
    if moe_blocks is None:
        moe_blocks = m.moe.layer_indices(m.n_layers)
    counts = count_params(m, moe_blocks)
    per = flops_per_token(counts, m.d_model, m.vocab_size, seq_len, m.n_layers, block_shape(m).top_k)
    return 3 * (len(moe_blocks) * per["expert"] + per["other"])
