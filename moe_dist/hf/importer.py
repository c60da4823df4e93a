"""``moe-dist import``: a Hugging Face MoE checkpoint (Mixtral, OLMoE, Qwen2-MoE) -> our checkpoint.

The output directory is laid out as ``moe-dist upcycle`` writes it, so everything that reads an
upcycled model reads it: ``config.yaml`` (our config, ``ckpt.init_from`` pointing at the
directory, ``data.tokenizer`` at the copied tokenizer), ``model.safetensors`` (or shards + index)
with experts stored as whole ``[num_experts, ...]`` tensors by global expert, so every rank of any
world size and expert-parallel size reads just its rows (:func:`moe_dist.weights.load_model_weights`),
the tokenizer files, and ``import.json`` (written last: its presence means a finished import).
The directory is written beside ``--out`` and moved into place when complete
(:class:`~moe_dist.weights.OutputDirectory`): a failed import leaves ``--out`` as it was.
``import.json`` also keeps the source's config.json values our config does not hold
(:data:`~moe_dist.hf.config.KEPT_KEYS`: token ids, context length, ``router_aux_loss_coef``),
which ``moe-dist export`` writes back, and lists the values that changed on the way and why.

Before anything is written, the whole checkpoint is checked from its headers: every tensor the
config implies, with its shape, and no tensor it does not explain.

Weights are streamed a block at a time (the experts of one block are the largest piece held).
The architecture is fixed by the checkpoint: the keys it determines (sizes, norms, RoPE,
experts, top-k, router and its gate normalisation) cannot be overridden; training, data,
capacity and loss settings can.
"""
from __future__ import annotations

import copy
import time
from typing import Callable, Iterable, Optional

import torch

from ..config import Config, ConfigError, apply_overrides, config_from_dict
from .config import HFModelSpec, source_dtype
from .moe_checkpoint import MoECheckpoint
from .written import write_converted

# our model keys the checkpoint fixes, with the config.json key that holds each
FIXED_MODEL_KEYS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
                    "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
                    "d_ff": "intermediate_size", "rope_theta": "rope_theta", "rope_scaling": "rope_scaling",
                    "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
                    "qkv_bias": "attention_bias", "qk_norm": "model_type (q/k norms)"}
FIXED_MOE_KEYS = {"layers": "model_type, decoder_sparse_step, mlp_only_layers (which blocks are MoE)", "num_experts": "the number of experts",
                  "top_k": "num_experts_per_tok", "d_ff": "intermediate_size (experts)",
                  "router": "model_type (softmax top-k router)", "router_options": "the gate normalisation",
                  "activation": "hidden_act (SwiGLU experts)",
                  "shared_d_ff": "shared_expert_intermediate_size", "shared_gate": "model_type (shared_expert_gate)"}


def _same(a, b) -> bool:
    return a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and float(a) == float(b))


def import_config(spec: HFModelSpec, overrides: Iterable[str] = (), base: Optional[dict] = None) -> Config:
    """Our config for the imported model: ``base`` (a preset's mapping), then ``KEY=VALUE``
    overrides, then the architecture from config.json. Overriding an architecture key with a
    different value is refused: the weights fix it."""
    raw = apply_overrides(copy.deepcopy(base or {}), overrides)
    model = raw.setdefault("model", {})
    if not isinstance(model, dict):
        raise ConfigError("model: expected a mapping")
    moe = model.setdefault("moe", {})
    if not isinstance(moe, dict):
        raise ConfigError("model.moe: expected a mapping")
    ours_moe = {"activation": "swiglu", **spec.model["moe"]}
    for section, fixed, ours, prefix in ((model, FIXED_MODEL_KEYS, spec.model, "model"),
                                         (moe, FIXED_MOE_KEYS, ours_moe, "model.moe")):
        for key, theirs in fixed.items():
            want = ours.get(key, "none" if key == "qk_norm" else None)
            if key in section and not _same(section[key], want):
                raise ConfigError(f"{prefix}.{key}: {section[key]!r} differs from the checkpoint's {want!r} "
                                  f"({spec.family} {theirs}); the imported weights fix it (leave {prefix}.{key} "
                                  f"out or set it to {want!r})")
            section[key] = copy.deepcopy(want)
    return config_from_dict(raw)


def changed_on_import(spec: HFModelSpec, cfg: Config, out_dtype: torch.dtype, dtype: str) -> list[dict]:
    """The source's values that our imported model holds differently, each with the reason."""
    changed = []
    theirs, ours = spec.model["moe"]["aux_loss_coef"], cfg.model.moe.aux_loss_coef
    if not _same(theirs, ours):
        changed.append({"key": "router_aux_loss_coef", "source": theirs, "ours": ours,
                        "why": "training weighs our load-balancing loss with model.moe.aux_loss_coef, which the config "
                               "sets; `moe-dist export` writes the source's value back"})
    stored, written = source_dtype(spec.raw), str(out_dtype).replace("torch.", "")
    if stored is not None and stored != written:
        changed.append({"key": "dtype", "source": stored, "ours": written,
                        "why": f"--dtype {dtype}" if dtype != "auto" else "weights of this dtype are written as float32"})
    return changed


@torch.no_grad()
def import_hf(hf_dir: str, out_dir: str, overrides: Iterable[str] = (), *, base: Optional[dict] = None,
              dtype: str = "auto", max_shard_bytes: int = 4 << 30, log: Callable[[str], None] = print) -> dict:
    """Read ``hf_dir`` (a Hugging Face MoE checkpoint directory) and write our checkpoint to
    ``out_dir`` (replaced only when complete); returns what ``import.json`` records."""
    t0 = time.perf_counter()
    ckpt = MoECheckpoint(hf_dir)
    for note in ckpt.spec.notes:
        log(f"note: {note}")
    cfg = import_config(ckpt.spec, overrides, base)

    def tensors():
        from ..model import build_model

        # the model built on the meta device (no memory): every streamed tensor must be one of its
        # tensors with its shape, and every one of its tensors must come (a mapping check)
        expected = {k: tuple(v.shape) for k, v in build_model(cfg.model, cfg.model.vocab_size, device="meta")
                    .state_dict().items()}
        if cfg.model.tie_embeddings:
            expected.pop("lm_head.weight")
        for name, t in ckpt.tensors():
            if expected.pop(name, None) != tuple(t.shape):
                raise RuntimeError(f"import: {name} {list(t.shape)} is not a tensor of the model built from the config")
            yield name, t
        if expected:
            raise RuntimeError(f"import: no weights mapped to {sorted(expected)[:8]}")

    def record(out_dtype: torch.dtype) -> dict:
        return {"architecture": ckpt.arch.causal_lm, "expert_layout": "fused" if ckpt.fused else "per_expert",
                "num_experts": cfg.model.moe.num_experts, "top_k": cfg.model.moe.top_k,
                "normalize_gates": cfg.model.moe.router_options["normalize"], "qk_norm": cfg.model.qk_norm,
                "changed": changed_on_import(ckpt.spec, cfg, out_dtype, dtype)}

    info, counts = write_converted("import", hf_dir, "Hugging Face checkpoint", out_dir, ckpt, cfg, dtype,
                                   tensors=tensors, record=record, max_shard_bytes=max_shard_bytes, log=log, started=t0)
    for change in info["changed"]:
        log(f"note: {change['key']}: the source's {change['source']!r} is {change['ours']!r} here ({change['why']})")
    gates = "renormalised" if info["normalize_gates"] else "the softmax probabilities"
    log(f"imported {ckpt.arch.causal_lm} ({hf_dir}) -> {out_dir}: {len(cfg.model.moe.layer_indices(cfg.model.n_layers))} MoE blocks x "
        f"{info['num_experts']} experts (top-{info['top_k']}, gates {gates}), "
        f"{counts['total']:,} parameters ({counts['active']:,} active), {info['dtype']}, {info['seconds']:.1f}s")
    return info
