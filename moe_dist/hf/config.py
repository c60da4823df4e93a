"""Hugging Face ``config.json`` -> the ``model`` section of our config.

Supported families (``model_type``): dense ``llama``, ``mistral``, ``qwen2``, ``phi3`` (the
ones that can be upcycled) and the MoE ``mixtral``, ``olmoe`` and ``qwen2_moe`` (``moe-dist import``, planner
input, export targets; their MoE specifics are in :mod:`moe_dist.hf.architectures`). Anything
our decoder cannot reproduce exactly is refused with the config key, what it holds and what
is allowed; features that only matter beyond some sequence length (sliding windows) are
reported as notes instead.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config.schema import ROPE_SCALING_KEYS
from ..errors import HFFormatError
from ..safe_io import MIB, UnreadableFile, read_json
from .architectures import MOE_ARCHITECTURES

DENSE_FAMILIES = ("llama", "mistral", "qwen2", "phi3")
MOE_FAMILIES = ("mixtral", "olmoe", "qwen2_moe")  # the keys of hf.architectures.MOE_ARCHITECTURES
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES

# family defaults of transformers' config classes, for keys a config.json may omit
_DEFAULTS = {
    "llama": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    "mistral": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    "qwen2": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6},
    "phi3": {"rope_theta": 10000.0, "rms_norm_eps": 1e-5},
    "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5},
    "olmoe": {"rope_theta": 10000.0, "rms_norm_eps": 1e-5},
    "qwen2_moe": {"rope_theta": 10000.0, "rms_norm_eps": 1e-6},
}


@dataclass
class HFModelSpec:
    """What we read from a config.json: the family, our ``model`` section, and notes."""

    family: str
    model: dict  # keys of moe_dist.config.ModelConfig (and model.moe for MoE families)
    raw: dict
    notes: list[str] = field(default_factory=list)

    @property
    def is_moe(self) -> bool:
        return self.family in MOE_FAMILIES

    @property
    def head_dim(self) -> int:
        return self.model["d_model"] // self.model["n_heads"]


def config_path(path: str) -> str:
    """``path`` itself if it is a file, else ``path/config.json``."""
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def read_hf_config(path: str) -> dict:
    """The parsed config.json of a checkpoint directory (or the file itself)."""
    cfg_file = config_path(path)
    if not os.path.exists(cfg_file):
        raise HFFormatError(f"{cfg_file}: no config.json (a Hugging Face checkpoint directory holds config.json and "
                            "*.safetensors)")
    try:
        raw = read_json(cfg_file, 16 * MIB)
    except UnreadableFile as e:
        raise HFFormatError(str(e)) from None
    if not isinstance(raw, dict):
        raise HFFormatError(f"{cfg_file}: expected a JSON object, got {type(raw).__name__}")
    return raw


def is_hf_config(raw: Any) -> bool:
    """A mapping that looks like a Hugging Face config (rather than one of our YAML configs)."""
    return isinstance(raw, dict) and ("model_type" in raw or "architectures" in raw) and "model" not in raw


def _require(raw: dict, key: str, where: str) -> Any:
    if raw.get(key) is None:
        raise HFFormatError(f"{where}: config.json has no {key!r}")
    return raw[key]


def _family(raw: dict, where: str) -> str:
    family = raw.get("model_type")
    if family is None:
        archs = raw.get("architectures") or []
        guess = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Phi3ForCausalLM": "phi3", "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe",
                 "Qwen2MoeForCausalLM": "qwen2_moe"}
        family = next((guess[a] for a in archs if a in guess), None)
    if family not in FAMILIES:
        raise HFFormatError(f"{where}: model_type={raw.get('model_type')!r} (architectures={raw.get('architectures')}) "
                            f"is not supported; allowed model_type: {list(FAMILIES)}")
    return family


def _rope(raw: dict, family: str, where: str) -> tuple[float, Optional[dict]]:
    """``(rope_theta, our model.rope_scaling)`` from either the transformers 5 ``rope_parameters``
    or the older ``rope_theta`` + ``rope_scaling`` keys. Supported: unscaled, ``linear`` and
    ``llama3`` RoPE over the whole head."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", raw.get("rope_theta"))
        scaling = params
        key = "rope_parameters"
    else:
        theta = raw.get("rope_theta")
        scaling = raw.get("rope_scaling") or {}
        key = "rope_scaling"
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    if rope_type == "su" or (rope_type == "yarn" and family == "phi3"):  # older names of Phi-3's LongRoPE
        rope_type = "longrope"
    if rope_type not in ("default", *ROPE_SCALING_KEYS):
        raise HFFormatError(f"{where}: {key}.rope_type={rope_type!r} is not supported; allowed: "
                            f"{['default', *ROPE_SCALING_KEYS]} (e.g. Phi-3-mini-4k, Llama-2/3.x, Mistral, Qwen2)")
    partial = scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise HFFormatError(f"{where}: partial_rotary_factor={partial} is not supported; allowed: 1.0 (RoPE on the whole head)")
    ours = None
    if rope_type == "longrope":
        scaling = _longrope(raw, scaling)
    if rope_type != "default":
        missing = [k for k in ROPE_SCALING_KEYS[rope_type] if scaling.get(k) is None]
        if missing:
            raise HFFormatError(f"{where}: {key} of type {rope_type!r} lacks {missing}")
        ours = {"type": rope_type, **{k: scaling[k] for k in ROPE_SCALING_KEYS[rope_type]}}
    return float(theta if theta is not None else _DEFAULTS[family]["rope_theta"]), ours


def _longrope(raw: dict, scaling: dict) -> dict:
    """LongRoPE's parameters with the original context and the cos/sin scale made explicit
    (transformers derives them from max_position_embeddings when the config omits them)."""
    scaling = dict(scaling)
    original = scaling.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if original is None:
        return scaling
    scaling["original_max_position_embeddings"] = original
    if scaling.get("attention_factor") is None:
        factor = scaling.get("factor") or raw.get("max_position_embeddings", original) / original
        scaling["attention_factor"] = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return scaling


def hf_model_spec(raw: dict, where: str = "config.json") -> HFModelSpec:
    """Check a Hugging Face config and translate it into our ``model`` section."""
    family = _family(raw, where)
    notes: list[str] = []
    d_model = int(_require(raw, "hidden_size", where))
    n_heads = int(_require(raw, "num_attention_heads", where))
    n_kv = int(raw.get("num_key_value_heads") or n_heads)
    n_layers = int(_require(raw, "num_hidden_layers", where))
    d_ff = int(_require(raw, "intermediate_size", where))
    vocab = int(_require(raw, "vocab_size", where))
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise HFFormatError(f"{where}: hidden_act={act!r} is not supported; allowed: 'silu' (SwiGLU feed-forward)")
    if d_model % n_heads:
        raise HFFormatError(f"{where}: num_attention_heads={n_heads} does not divide hidden_size={d_model}")
    head_dim = raw.get("head_dim")
    if head_dim is not None and int(head_dim) != d_model // n_heads:
        raise HFFormatError(f"{where}: head_dim={head_dim} differs from hidden_size / num_attention_heads = "
                            f"{d_model // n_heads}; allowed: head_dim = hidden_size / num_attention_heads")
    if n_heads % n_kv:
        raise HFFormatError(f"{where}: num_key_value_heads={n_kv} does not divide num_attention_heads={n_heads}")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise HFFormatError(f"{where}: {key}=true is not supported; allowed: false")
    window = raw.get("sliding_window")
    uses_window = window is not None and (family not in ("qwen2", "qwen2_moe")
                                                     or raw.get("use_sliding_window", False))
    if uses_window:
        notes.append(f"sliding_window={window} is not modelled: attention is fully causal, which is the same as the "
                     f"checkpoint's for sequences of at most {window} tokens")
    rope_theta, rope_scaling = _rope(raw, family, where)
    model = {
        "vocab_size": vocab, "d_model": d_model, "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv,
        "d_ff": d_ff, "rope_theta": rope_theta, "rope_scaling": rope_scaling,
        "norm_eps": float(raw.get("rms_norm_eps", _DEFAULTS[family]["rms_norm_eps"])),
        "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "qkv_bias": family == "qwen2" or (family == "qwen2_moe" and bool(raw.get("qkv_bias", True))),
    }
    if family in MOE_FAMILIES:
        moe_keys, moe_notes = MOE_ARCHITECTURES[family].moe_section(raw, where)
        model.update(moe_keys)
        notes += moe_notes
    return HFModelSpec(family=family, model=model, raw=raw, notes=notes)


# config.json values our config does not hold that an export writes back as the source had them
KEPT_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "router_aux_loss_coef")


def kept_values(raw: dict) -> dict:
    """The source's values of :data:`KEPT_KEYS` (those it sets), recorded by import / upcycle for export."""
    return {k: raw[k] for k in KEPT_KEYS if raw.get(k) is not None}


def source_dtype(raw: dict) -> Optional[str]:
    """The checkpoint's stored dtype name (``bfloat16``, ``float32``...), if the config says."""
    value = raw.get("dtype", raw.get("torch_dtype"))
    return value if isinstance(value, str) else None
