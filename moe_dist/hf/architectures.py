"""Hugging Face MoE architectures, one table entry each: how their config.json describes the
MoE part, where their tensors sit, and which of their options we reproduce.

Adding an architecture = one more :class:`MoEArchitecture` in
:data:`MOE_ARCHITECTURES`; the reader (:mod:`moe_dist.hf.moe_checkpoint`), ``moe-dist import``
and ``moe-dist export --format`` take it from here.

All supported families use SwiGLU experts and a softmax router with top-k:

* Mixtral (``MixtralForCausalLM``): gates renormalised over the top-k; tensors
  ``model.layers.{i}.block_sparse_moe.gate.weight`` and ``...experts.{j}.w1/w3/w2.weight``.
* OLMoE (``OlmoeForCausalLM``): softmax over all experts, the top-k probabilities used as they
  are unless ``norm_topk_prob``; RMSNorm over the whole q and k projections before RoPE;
  tensors ``model.layers.{i}.mlp.gate.weight``, ``...mlp.experts.{j}.gate_proj/up_proj/down_proj``,
  ``...self_attn.q_norm/k_norm.weight``.
* Qwen2-MoE (``Qwen2MoeForCausalLM``): OLMoE's router and tensor names, fine-grained experts
  (``moe_intermediate_size``), a shared expert scaled by ``sigmoid(shared_expert_gate(x))``
  (``...mlp.shared_expert.gate_proj/up_proj/down_proj``, ``...mlp.shared_expert_gate.weight``),
  q/k/v biases (``qkv_bias``), and dense blocks (``intermediate_size``, tensors
  ``...mlp.gate_proj/up_proj/down_proj``) where ``mlp_only_layers`` or ``decoder_sparse_step``
  say so: block ``i`` is MoE iff ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``,
  which our ``model.moe.layers`` holds as a list.

Our router ``topk`` with ``normalize`` true / false computes either rule exactly (its top-k over
the logits picks the same experts as a top-k over the softmax).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..errors import HFFormatError


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
    moe_extras: Callable[[dict, str, int], dict] = lambda raw, where, n_layers: {}  # (raw, where, n_layers) -> model.moe keys
    shared_expert: bool = False  # every MoE block has a gated shared expert (Qwen2-MoE)
    dense_blocks: bool = False  # the format holds dense blocks (else every block is an MoE block)
    qkv_bias: bool = False  # the format holds q/k/v biases
    fused_module: str = "mlp"  # the MoE block's name in transformers' own model (the fused expert layout)

    # ---- tensor names ---------------------------------------------------------------------
    def router_name(self, prefix: str, i: int, fused: bool = False) -> str:
        return f"{prefix}layers.{i}.{self.fused_module if fused else self.moe_module}.gate.weight"

    def fused_expert_names(self, prefix: str, i: int) -> tuple[str, str]:
        """Block ``i``'s fused expert tensors: ``gate_up_proj`` ``[E, 2 ff, d]``, ``down_proj`` ``[E, d, ff]``."""
        base = f"{prefix}layers.{i}.{self.fused_module}.experts."
        return base + "gate_up_proj", base + "down_proj"

    def expert_name(self, prefix: str, i: int, j: int, which: int) -> str:
        """``which``: 0 gate, 1 up, 2 down."""
        return f"{prefix}layers.{i}.{self.moe_module}.experts.{j}.{self.expert_linears[which]}.weight"

    def shared_name(self, prefix: str, i: int, which: int) -> str:
        """The shared expert's linear ``which`` (0 gate, 1 up, 2 down)."""
        return f"{prefix}layers.{i}.{self.moe_module}.shared_expert.{self.expert_linears[which]}.weight"

    def shared_gate_name(self, prefix: str, i: int) -> str:
        return f"{prefix}layers.{i}.{self.moe_module}.shared_expert_gate.weight"

    def dense_name(self, prefix: str, i: int, which: int) -> str:
        """A dense block's feed-forward linear ``which`` (0 gate, 1 up, 2 down)."""
        return f"{prefix}layers.{i}.{self.moe_module}.{self.expert_linears[which]}.weight"

    # ---- config.json -> our model section -------------------------------------------------
    def moe_section(self, raw: dict, where: str) -> tuple[dict, list[str]]:
        """``(model keys, notes)``: our ``model.moe`` and what else the family fixes (q/k norm)."""
        for r in self.refused:
            value = raw.get(r.key, r.allowed)
            if value != r.allowed:
                raise HFFormatError(f"{where}: {r.key}={value!r} is not supported ({r.why}); allowed: {r.allowed!r}")
        notes = [f"{key}={raw[key]!r} acts only in training in transformers and is not reproduced (we train with "
                 f"{neutral!r})" for key, neutral in self.training_only if raw.get(key, neutral) not in (neutral, None)]
        if raw.get("router_aux_loss_coef") is not None:
            notes.append(f"router_aux_loss_coef={raw['router_aux_loss_coef']!r} (a training setting) does not set our "
                         "training: our load-balancing loss weighs model.moe.aux_loss_coef, which the config sets; "
                         "`moe-dist export` writes the source's value back")
        if raw.get(self.experts_key) is None:
            raise HFFormatError(f"{where}: config.json has no {self.experts_key!r} (experts per MoE block)")
        moe = {"layers": "every", "num_experts": int(raw[self.experts_key]),
               "top_k": int(raw.get("num_experts_per_tok", self.defaults["num_experts_per_tok"])),
               "router": "topk", "router_options": {"normalize": bool(self.normalize(raw))}, "d_ff": None,
               "aux_loss_coef": float(raw.get("router_aux_loss_coef", self.defaults["router_aux_loss_coef"])),
               "shared_d_ff": None, "shared_gate": False}
        moe.update(self.moe_extras(raw, where, int(raw.get("num_hidden_layers") or 0)))
        return {"moe": moe, "qk_norm": self.qk_norm}, notes

    # ---- our model -> config.json ---------------------------------------------------------
    def hf_config(self, cfg, normalize: bool, dtype_name: str, max_position_embeddings: int,
                  rope_scaling: Optional[dict], kept: Optional[dict] = None) -> dict:
        """config.json of our model (``normalize``: its routers renormalise the top-k gates; ``kept``:
        values of :data:`~moe_dist.hf.config.KEPT_KEYS` taken from the imported source instead)."""
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
        out.update(kept or {})
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



def _qwen2_moe_section(raw: dict, where: str, n_layers: int) -> dict:
    """Qwen2-MoE's expert and shared-expert sizes and which blocks are MoE blocks (transformers'
    rule: ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``)."""
    step = raw.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise HFFormatError(f"{where}: decoder_sparse_step={step!r} is not supported; allowed: an integer >= 1")
    dense_only = raw.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(isinstance(i, int) for i in dense_only):
        raise HFFormatError(f"{where}: mlp_only_layers={dense_only!r} is not supported; allowed: a list of block indices")
    layers = [i for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0]
    if not layers:
        raise HFFormatError(f"{where}: decoder_sparse_step={step} with mlp_only_layers={dense_only} leaves no MoE block "
                            f"among num_hidden_layers={n_layers}; allowed: at least one MoE block (a dense model is read "
                            "by `moe-dist upcycle`)")
    shared = raw.get("shared_expert_intermediate_size", 5632)
    if not isinstance(shared, int) or shared < 1:
        raise HFFormatError(f"{where}: shared_expert_intermediate_size={shared!r} is not supported; allowed: an integer >= 1")
    return {"layers": "every" if len(layers) == n_layers else layers,
            "d_ff": int(raw.get("moe_intermediate_size", 1408)), "shared_d_ff": shared, "shared_gate": True}


def _qwen2_moe_export(cfg, normalize: bool) -> dict:
    m = cfg.model
    moe_blocks = set(m.moe.layer_indices(m.n_layers))
    return {"intermediate_size": m.d_ff, "moe_intermediate_size": m.moe.d_ff or m.d_ff,
            "shared_expert_intermediate_size": m.moe.shared_d_ff, "norm_topk_prob": normalize,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(m.n_layers) if i not in moe_blocks],
            "qkv_bias": bool(m.qkv_bias), "use_sliding_window": False, "sliding_window": None}


QWEN2_MOE = MoEArchitecture(
    family="qwen2_moe", display="Qwen2-MoE", causal_lm="Qwen2MoeForCausalLM", experts_key="num_experts",
    moe_module="mlp", expert_linears=("gate_proj", "up_proj", "down_proj"), qk_norm="none",
    normalize=lambda raw: bool(raw.get("norm_topk_prob", False)),
    defaults={"num_experts_per_tok": 4, "router_aux_loss_coef": 0.001},
    training_only=(("attention_dropout", 0.0),),
    moe_extras=_qwen2_moe_section, export_extras=_qwen2_moe_export,
    shared_expert=True, dense_blocks=True, qkv_bias=True,
)

MOE_ARCHITECTURES: dict[str, MoEArchitecture] = {a.family: a for a in (MIXTRAL, OLMOE, QWEN2_MOE)}
