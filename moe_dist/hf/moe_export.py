"""Write our MoE model as a Hugging Face MoE checkpoint (config.json + safetensors) of one of
the families in :mod:`moe_dist.hf.architectures` (Mixtral, OLMoE, Qwen2-MoE), which ``transformers``
loads with ``AutoModelForCausalLM.from_pretrained``.

Both families route with ``softmax(x W_gate^T)`` and keep the top-k; Mixtral always
renormalises the k weights, OLMoE does so only with ``norm_topk_prob`` (written from our
router's ``normalize``). Every block is an MoE block and experts are SwiGLU
``w2(silu(w1 x) * w3 x)``; OLMoE's attention always has q/k RMSNorm over the projections and
Mixtral's never. So a model exports exactly when its router is that router (``topk`` /
``noisy_topk``, whose noise is off in evaluation), its q/k norm is the family's and it has no
q/k/v biases; anything else is refused with the reason. Qwen2-MoE (``norm_topk_prob`` as OLMoE)
holds q/k/v biases, dense blocks (``mlp_only_layers``) of their own size, and needs a shared
expert in every MoE block, scaled by ``sigmoid(shared_expert_gate(x))``: a shared expert without
our gate is written with a zero gate (sigmoid 0 = 1/2) and its down projection doubled, the same
function. In Mixtral and OLMoE, dense blocks of a partly-MoE model
(``every_other``, lists) are written as MoE blocks whose experts are all the dense FFN with a
zero router: all experts then get probability 1/E, so the top-k gates sum to one when
renormalised, and to k/E otherwise, which the copies' down projections undo (scaled by E/k):
the function is unchanged (at the cost of E copies in the file). Weights use the per-expert
names (``...experts.{j}.w1.weight``, ``...experts.{j}.gate_proj.weight``) that every
transformers version reads.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..moe import moe_layers
from ..weights import ShardedWriter
from .architectures import MoEArchitecture
from .config import HFFormatError

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_exportable(model, cfg, arch: MoEArchitecture) -> list[str]:
    """Raise HFFormatError if ``model`` cannot be written in ``arch``'s format; returns notes."""
    m, name = cfg.model, arch.display
    notes = []
    from ..moe.routers import ROUTERS  # registry: routers register on import

    exportable = sorted(router for router, cls in ROUTERS.items() if cls.hf_exportable)
    if m.moe.router not in exportable:
        raise HFFormatError(f"model.moe.router={m.moe.router!r} cannot be exported to {name}, whose router is "
                            f"softmax(x W) top-k; allowed routers: {exportable}")
    if m.moe.activation != "swiglu":
        raise HFFormatError(f"model.moe.activation={m.moe.activation!r} cannot be exported to {name} (SwiGLU experts); "
                            "allowed: 'swiglu'")
    if m.qkv_bias and not arch.qkv_bias:
        raise HFFormatError(f"model.qkv_bias=true cannot be exported to {name} (no attention biases); allowed: false")
    if m.moe.shared_d_ff and not arch.shared_expert:
        raise HFFormatError(f"model.moe.shared_d_ff cannot be exported to {name} (no shared experts); allowed: null")
    if arch.shared_expert and not m.moe.shared_d_ff:
        raise HFFormatError(f"model.moe.shared_d_ff=null cannot be exported to {name}, whose MoE blocks always have a "
                            "shared expert; allowed: an integer >= 1 (a model without one: --format mixtral or olmoe)")
    if m.moe.expert_bias:
        raise HFFormatError(f"model.moe.expert_bias=true cannot be exported to {name} (its router has no selection "
                            "bias); allowed: false")
    if m.moe.max_groups_per_token is not None:
        raise HFFormatError(f"model.moe.max_groups_per_token={m.moe.max_groups_per_token} cannot be exported to {name} "
                            "(its router chooses from all experts, without expert groups); allowed: null")
    if m.qk_norm != arch.qk_norm:
        has = "always normalises" if arch.qk_norm != "none" else "never normalises"
        raise HFFormatError(f"model.qk_norm={m.qk_norm!r} cannot be exported to {name}, whose attention {has} the "
                            f"queries and keys; allowed: {arch.qk_norm!r}")
    for layer in moe_layers(model):
        if arch.family == "mixtral" and not layer.router.renormalizes_gates:
            raise HFFormatError(f"block {layer.context.layer_idx}: the router does not renormalise its gates over the "
                                "top-k (model.moe.router_options.normalize), which Mixtral always does; allowed: "
                                "normalize=true (OLMoE's format holds both: --format olmoe)")
        if layer.experts.num_experts != layer.num_experts:
            raise HFFormatError("the model holds a slice of the experts (expert parallelism applied); export the full model")
    if m.moe.eval_capacity_factor is not None or m.moe.capacity_factor is not None:
        notes.append(f"{name} is dropless: the exported model never drops tokens, whereas this config's capacity "
                     "factor may drop some in evaluation")
    dense = [b.idx for b in model.blocks if not b.is_moe]
    if dense and not arch.dense_blocks:
        notes.append(f"dense blocks {dense} are written as {m.moe.num_experts} identical experts with a zero router "
                     f"(same function, {name} has MoE in every block)")
    return notes


def _rope_scaling(scaling: Optional[dict]) -> Optional[dict]:
    """Our model.rope_scaling in the config.json form transformers reads (``rope_type`` + parameters)."""
    if not scaling:
        return None
    return {"rope_type": scaling["type"], **{k: v for k, v in scaling.items() if k != "type"}}


def _dense_as_experts(ffn, E: int, k: int, d_ff: int, normalized: bool):
    """A dense SwiGLU's (w1, w3, w2) in the HF per-expert layout, zero-padded to ``d_ff`` (padded
    units compute silu(0) * 0 = 0), repeated for E experts; without gate renormalisation the
    down projection is scaled by E/k (a zero router gives each of the k chosen experts 1/E)."""
    w1, w3, w2 = ffn.w1.weight, ffn.w3.weight, ffn.w2.weight  # [ff, d], [ff, d], [d, ff]
    pad = d_ff - w1.shape[0]
    if pad < 0:
        raise HFFormatError(f"the dense FFN ({w1.shape[0]}) is wider than the experts (model.moe.d_ff={d_ff}); "
                            "the format has one intermediate_size, so it cannot hold both")
    if pad:
        w1, w3 = F.pad(w1, (0, 0, 0, pad)), F.pad(w3, (0, 0, 0, pad))
        w2 = F.pad(w2, (0, pad))
    if not normalized:
        w2 = w2 * (E / k)
    return [(w1, w3, w2)] * E


def _put_shared(put, arch: MoEArchitecture, prefix: str, i: int, layer) -> None:
    """Block ``i``'s shared expert and its gate; without our gate a zero gate (sigmoid 0 = 1/2)
    and a doubled down projection compute the same."""
    se, gate = layer.shared_expert, layer.shared_expert_gate
    for which, w in enumerate((se.w1.weight, se.w3.weight, se.w2.weight if gate is not None else 2 * se.w2.weight)):
        put(arch.shared_name(prefix, i, which), w)
    put(arch.shared_gate_name(prefix, i), gate.weight if gate is not None else torch.zeros(1, se.w1.weight.shape[1]))


@torch.no_grad()
def export_moe(model, cfg, out_dir: str, arch: MoEArchitecture, dtype: torch.dtype = torch.float32,
               tokenizer_dir: Optional[str] = None, max_position_embeddings: int = 32768,
               kept: Optional[dict] = None, metadata: Optional[dict] = None, max_shard_bytes: int = 4 << 30,
               log: Callable[[str], None] = print) -> dict:
    """Write ``model`` (a full, single-process TransformerLM) to ``out_dir`` in ``arch``'s format
    (``kept``: config.json values taken from the imported source, ``max_position_embeddings``
    included; ``metadata``: extra safetensors metadata)."""
    from .tokenizer import copy_tokenizer

    notes = check_exportable(model, cfg, arch)
    m = cfg.model
    E, k, d_ff = m.moe.num_experts, m.moe.top_k, m.moe.d_ff or m.d_ff
    normalized = all(layer.router.renormalizes_gates for layer in moe_layers(model))
    os.makedirs(out_dir, exist_ok=True)
    writer = ShardedWriter(out_dir, max_shard_bytes, metadata={"format": "pt", **(metadata or {})})

    def put(name: str, t: torch.Tensor) -> None:
        writer.add(name, t.detach().to("cpu", dtype).contiguous())

    prefix = "model."
    put("model.embed_tokens.weight", model.embed.weight)
    for block in model.blocks:
        i, p = block.idx, f"model.layers.{block.idx}."
        put(p + "input_layernorm.weight", block.attn_norm.weight)
        put(p + "post_attention_layernorm.weight", block.ffn_norm.weight)
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            put(p + f"self_attn.{theirs}.weight", getattr(block.attn, ours).weight)
            if getattr(block.attn, ours).bias is not None:  # q/k/v biases (checked: the format holds them)
                put(p + f"self_attn.{theirs}.bias", getattr(block.attn, ours).bias)
        if block.attn.q_norm is not None:
            put(p + "self_attn.q_norm.weight", block.attn.q_norm.weight)
            put(p + "self_attn.k_norm.weight", block.attn.k_norm.weight)
        if not block.is_moe and arch.dense_blocks:  # written as a dense block (Qwen2-MoE's mlp_only_layers)
            for which, ours in enumerate(("w1", "w3", "w2")):
                put(arch.dense_name(prefix, i, which), getattr(block.ffn, ours).weight)
            continue
        if block.is_moe:
            ex = block.ffn.experts
            put(arch.router_name(prefix, i), block.ffn.router.weight)
            experts = [(ex.w1[j].t(), ex.w3[j].t(), ex.w2[j].t()) for j in range(E)]
            if arch.shared_expert:
                _put_shared(put, arch, prefix, i, block.ffn)
        else:
            put(arch.router_name(prefix, i), torch.zeros(E, m.d_model))
            experts = _dense_as_experts(block.ffn, E, k, d_ff, normalized)
        for j, weights in enumerate(experts):
            for which, w in enumerate(weights):
                put(arch.expert_name(prefix, i, j, which), w)
    put("model.norm.weight", model.norm.weight)
    if not m.tie_embeddings:
        put("lm_head.weight", model.lm_head.weight)
    files = writer.close()
    config = arch.hf_config(cfg, normalized, _DTYPE_NAMES[dtype], max_position_embeddings, _rope_scaling(m.rope_scaling),
                            kept)
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    copied = copy_tokenizer(tokenizer_dir, out_dir) if tokenizer_dir else []
    for note in notes:
        log(f"note: {note}")
    return {"files": files, "config": config, "tokenizer_files": copied, "notes": notes,
            "bytes": writer.total_bytes}
