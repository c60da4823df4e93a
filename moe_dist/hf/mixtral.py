"""Write our MoE model as a Hugging Face Mixtral checkpoint (config.json + safetensors) that
``transformers`` loads with ``AutoModelForCausalLM.from_pretrained``.

Mixtral's MoE block routes with ``softmax(x W_gate^T)``, keeps the top-k and renormalises
their weights; every block is an MoE block and experts are SwiGLU ``w2(silu(w1 x) * w3 x)``.
So a model exports exactly when its router is that router (``topk`` / ``noisy_topk``, whose
noise is off in evaluation, with gates renormalised) and it has no q/k/v biases. Dense blocks
of a partly-MoE model (``every_other``, lists) are written as MoE blocks whose experts are all
the dense FFN with a zero router: any top-k of identical experts with renormalised gates is
that FFN, so the function is unchanged (at the cost of E copies in the file). Weights use the
per-expert names (``block_sparse_moe.experts.{j}.w1.weight``) that every transformers version
reads.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .config import HFFormatError
from .safetensors_io import ShardedWriter

EXPORTABLE_ROUTERS = ("topk", "noisy_topk")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_exportable(model, cfg) -> list[str]:
    """Raise HFFormatError if ``model`` cannot be written as Mixtral; returns notes."""
    m = cfg.model
    notes = []
    if m.moe.router not in EXPORTABLE_ROUTERS:
        raise HFFormatError(f"model.moe.router={m.moe.router!r} cannot be exported to Mixtral, whose router is "
                            f"softmax(x W) top-k with renormalised gates; allowed routers: {list(EXPORTABLE_ROUTERS)}")
    if m.moe.activation != "swiglu":
        raise HFFormatError(f"model.moe.activation={m.moe.activation!r} cannot be exported to Mixtral (SwiGLU experts); "
                            "allowed: 'swiglu'")
    if m.qkv_bias:
        raise HFFormatError("model.qkv_bias=true cannot be exported to Mixtral (no attention biases); allowed: false")
    if m.moe.shared_d_ff:
        raise HFFormatError("model.moe.shared_d_ff cannot be exported to Mixtral (no shared experts); allowed: null")
    if m.moe.expert_bias:
        raise HFFormatError("model.moe.expert_bias=true cannot be exported to Mixtral (its router has no selection bias); "
                            "allowed: false")
    for layer in model.moe_layers():
        router = layer.router
        if not getattr(router, "normalize", False):
            raise HFFormatError(f"block {layer.context.layer_idx}: the router does not renormalise its gates over the "
                                "top-k (model.moe.router_options.normalize), which Mixtral always does; allowed: normalize=true")
        if layer.experts.num_experts != layer.num_experts:
            raise HFFormatError("the model holds a slice of the experts (expert parallelism applied); export the full model")
    if m.moe.eval_capacity_factor is not None or m.moe.capacity_factor is not None:
        notes.append("Mixtral is dropless: the exported model never drops tokens, whereas this config's capacity "
                     "factor may drop some in evaluation")
    dense = [b.idx for b in model.blocks if not b.is_moe]
    if dense:
        notes.append(f"dense blocks {dense} are written as {m.moe.num_experts} identical experts with a zero router "
                     "(same function, Mixtral has MoE in every block)")
    return notes


def _rope_scaling(scaling: Optional[dict]) -> Optional[dict]:
    """Our model.rope_scaling in the config.json form transformers reads (``rope_type`` + parameters)."""
    if not scaling:
        return None
    return {"rope_type": scaling["type"], **{k: v for k, v in scaling.items() if k != "type"}}


def mixtral_config(cfg, dtype: torch.dtype, max_position_embeddings: int) -> dict:
    m = cfg.model
    return {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
        "hidden_size": m.d_model, "intermediate_size": m.moe.d_ff or m.d_ff, "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads or m.n_heads,
        "head_dim": m.d_model // m.n_heads, "num_local_experts": m.moe.num_experts,
        "num_experts_per_tok": m.moe.top_k, "vocab_size": m.vocab_size, "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta, "rope_scaling": _rope_scaling(m.rope_scaling),
        "max_position_embeddings": max_position_embeddings, "sliding_window": None,
        "tie_word_embeddings": m.tie_embeddings, "router_aux_loss_coef": m.moe.aux_loss_coef,
        "router_jitter_noise": 0.0, "output_router_logits": False, "attention_dropout": 0.0,
        "initializer_range": m.init_std, "use_cache": True, "torch_dtype": _DTYPE_NAMES[dtype],
    }


def _dense_as_experts(ffn, E: int, d_ff: int):
    """A dense SwiGLU's (w1, w3, w2) in Mixtral layout, zero-padded to ``d_ff`` (padded units
    compute silu(0) * 0 = 0), repeated for E experts."""
    w1, w3, w2 = ffn.w1.weight, ffn.w3.weight, ffn.w2.weight  # [ff, d], [ff, d], [d, ff]
    pad = d_ff - w1.shape[0]
    if pad < 0:
        raise HFFormatError(f"the dense FFN ({w1.shape[0]}) is wider than the experts (model.moe.d_ff={d_ff}); "
                            "Mixtral has one intermediate_size, so it cannot hold both")
    if pad:
        w1, w3 = F.pad(w1, (0, 0, 0, pad)), F.pad(w3, (0, 0, 0, pad))
        w2 = F.pad(w2, (0, pad))
    return [(w1, w3, w2)] * E


@torch.no_grad()
def export_mixtral(model, cfg, out_dir: str, dtype: torch.dtype = torch.float32, tokenizer_dir: Optional[str] = None,
                   max_position_embeddings: int = 32768, max_shard_bytes: int = 4 << 30,
                   log: Callable[[str], None] = print) -> dict:
    """Write ``model`` (a full, single-process TransformerLM) to ``out_dir`` in Mixtral format."""
    from .tokenizer import copy_tokenizer

    notes = check_exportable(model, cfg)
    m = cfg.model
    E, d_ff = m.moe.num_experts, m.moe.d_ff or m.d_ff
    os.makedirs(out_dir, exist_ok=True)
    writer = ShardedWriter(out_dir, max_shard_bytes, metadata={"format": "pt"})

    def put(name: str, t: torch.Tensor) -> None:
        writer.add(name, t.detach().to("cpu", dtype).contiguous())

    put("model.embed_tokens.weight", model.embed.weight)
    for block in model.blocks:
        p = f"model.layers.{block.idx}."
        put(p + "input_layernorm.weight", block.attn_norm.weight)
        put(p + "post_attention_layernorm.weight", block.ffn_norm.weight)
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            put(p + f"self_attn.{theirs}.weight", getattr(block.attn, ours).weight)
        if block.is_moe:
            ex = block.ffn.experts
            put(p + "block_sparse_moe.gate.weight", block.ffn.router.weight)
            experts = [(ex.w1[j].t(), ex.w3[j].t(), ex.w2[j].t()) for j in range(E)]
        else:
            put(p + "block_sparse_moe.gate.weight", torch.zeros(E, m.d_model))
            experts = _dense_as_experts(block.ffn, E, d_ff)
        for j, (w1, w3, w2) in enumerate(experts):
            q = p + f"block_sparse_moe.experts.{j}."
            put(q + "w1.weight", w1)
            put(q + "w3.weight", w3)
            put(q + "w2.weight", w2)
    put("model.norm.weight", model.norm.weight)
    if not m.tie_embeddings:
        put("lm_head.weight", model.lm_head.weight)
    files = writer.close()
    config = mixtral_config(cfg, dtype, max_position_embeddings)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    copied = copy_tokenizer(tokenizer_dir, out_dir) if tokenizer_dir else []
    for note in notes:
        log(f"note: {note}")
    return {"files": files, "config": config, "tokenizer_files": copied, "notes": notes,
            "bytes": writer.total_bytes}
