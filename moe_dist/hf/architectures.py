"""Hugging Face MoE architectures, one table entry each: how their config.json describes the
MoE part, where their tensors sit, and which of their options we reproduce.

Adding an architecture (say Qwen2-MoE) = one more :class:`MoEArchitecture` in
:data:`MOE_ARCHITECTURES`; the reader (:mod:`moe_dist.hf.moe_checkpoint`), ``moe-dist import``
and ``moe-dist export --format`` take it from here.

Both supported families are "MoE in every block, SwiGLU experts, softmax router, top-k":

* Mixtral (``MixtralForCausalLM``): gates renormalised over the top-k; tensors
  ``model.layers.{i}.block_sparse_moe.gate.weight`` and ``...experts.{j}.w1/w3/w2.weight``.
* OLMoE (``OlmoeForCausalLM``): softmax over all experts, the top-k probabilities used as they
  are unless ``norm_topk_prob``; RMSNorm over the whole q and k projections before RoPE;
  tensors ``model.layers.{i}.mlp.gate.weight``, ``...mlp.experts.{j}.gate_proj/up_proj/down_proj``,
  ``...self_attn.q_norm/k_norm.weight``.

Our router ``topk`` with ``normalize`` true / false computes either rule exactly (its top-k over
the logits picks the same experts as a top-k over the softmax).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .config import HFFormatError


@dataclass(frozen=True)
class Refused:
    """A config.json option we do not reproduce: accepted only when it holds ``allowed``
    (a missing key counts as ``allowed``)."""

    key: str
    allowed: Any
    why: str


@dataclass(frozen=True)
class MoEArchitecture:
    family: str  # config.json model_type
    display: str  # the name in messages
    causal_lm: str  # the architectures entry of its causal LM
    experts_key: str  # config key: routed experts per MoE block
    moe_module: str  # the MoE block inside model.layers.{i}
    expert_linears: tuple[str, str, str]  # per-expert linear names: (gate, up, down)
    qk_norm: str  # our model.qk_norm
    normalize: Callable[[dict], bool]  # gates renormalised over the top-k, from config.json
    defaults: dict = field(default_factory=dict)  # values of keys a config.json may omit
    refused: tuple[Refused, ...] = ()
    training_only: tuple[tuple[str, Any], ...] = ()  # (key, neutral value): options that only act in training
    export_extras: Callable[[Any, bool], dict] = lambda cfg, normalize: {}  # its own config.json keys of an export

    # ---- tensor names ---------------------------------------------------------------------
    def router_name(self, prefix: str, i: int) -> str:
        return f"{prefix}layers.{i}.{self.moe_module}.gate.weight"

    def expert_name(self, prefix: str, i: int, j: int, which: int) -> str:
        """``which``: 0 gate, 1 up, 2 down."""
        return f"{prefix}layers.{i}.{self.moe_module}.experts.{j}.{self.expert_linears[which]}.weight"

    # ---- config.json -> our model section -------------------------------------------------
    def moe_section(self, raw: dict, where: str) -> tuple[dict, list[str]]:
        """``(model keys, notes)``: our ``model.moe`` and what else the family fixes (q/k norm)."""
        for r in self.refused:
            value = raw.get(r.key, r.allowed)
            if value != r.allowed:
                raise HFFormatError(f"{where}: {r.key}={value!r} is not supported ({r.why}); allowed: {r.allowed!r}")
        notes = [f"{key}={raw[key]!r} acts only in training in transformers and is not reproduced (we train with "
                 f"{neutral!r})" for key, neutral in self.training_only if raw.get(key, neutral) not in (neutral, None)]
        if raw.get(self.experts_key) is None:
            raise HFFormatError(f"{where}: config.json has no {self.experts_key!r} (experts per MoE block)")
        moe = {"layers": "every", "num_experts": int(raw[self.experts_key]),
               "top_k": int(raw.get("num_experts_per_tok", self.defaults["num_experts_per_tok"])),
               "router": "topk", "router_options": {"normalize": bool(self.normalize(raw))}, "d_ff": None,
               "aux_loss_coef": float(raw.get("router_aux_loss_coef", self.defaults["router_aux_loss_coef"]))}
        return {"moe": moe, "qk_norm": self.qk_norm}, notes

    # ---- our model -> config.json ---------------------------------------------------------
    def hf_config(self, cfg, normalize: bool, dtype_name: str, max_position_embeddings: int,
                  rope_scaling: Optional[dict]) -> dict:
        """config.json of our model (``normalize``: its routers renormalise the top-k gates)."""
        m = cfg.model
        out = {
            "architectures": [self.causal_lm], "model_type": self.family, "hidden_act": "silu",
            "hidden_size": m.d_model, "intermediate_size": m.moe.d_ff or m.d_ff, "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads or m.n_heads,
            self.experts_key: m.moe.num_experts, "num_experts_per_tok": m.moe.top_k, "vocab_size": m.vocab_size,
            "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "rope_scaling": rope_scaling,
            "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": m.tie_embeddings,
            "router_aux_loss_coef": m.moe.aux_loss_coef, "output_router_logits": False, "attention_dropout": 0.0,
            "attention_bias": False, "initializer_range": m.init_std, "use_cache": True, "torch_dtype": dtype_name,
        }
        out.update(self.export_extras(cfg, normalize))
        return out


MIXTRAL = MoEArchitecture(
    family="mixtral", display="Mixtral", causal_lm="MixtralForCausalLM", experts_key="num_local_experts",
    moe_module="block_sparse_moe", expert_linears=("w1", "w3", "w2"), qk_norm="none", normalize=lambda raw: True,
    defaults={"num_experts_per_tok": 2, "router_aux_loss_coef": 0.001},
    training_only=(("router_jitter_noise", 0.0), ("attention_dropout", 0.0)),
    export_extras=lambda cfg, normalize: {"head_dim": cfg.model.d_model // cfg.model.n_heads, "sliding_window": None,
                                          "router_jitter_noise": 0.0},
)

OLMOE = MoEArchitecture(
    family="olmoe", display="OLMoE", causal_lm="OlmoeForCausalLM", experts_key="num_experts", moe_module="mlp",
    expert_linears=("gate_proj", "up_proj", "down_proj"), qk_norm="projection",
    normalize=lambda raw: bool(raw.get("norm_topk_prob", False)),
    defaults={"num_experts_per_tok": 8, "router_aux_loss_coef": 0.01},
    refused=(Refused("clip_qkv", None, "clipping of the query, key and value activations"),),
    training_only=(("attention_dropout", 0.0),),
    export_extras=lambda cfg, normalize: {"clip_qkv": None, "norm_topk_prob": normalize},
)

MOE_ARCHITECTURES: dict[str, MoEArchitecture] = {a.family: a for a in (MIXTRAL, OLMOE)}
