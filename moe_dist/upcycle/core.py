"""Sparse upcycling: a dense decoder checkpoint becomes an MoE whose experts start as copies
of the dense feed-forward layer (Komatsuzaki et al., "Sparse Upcycling"; CuMo; the 4.2B and
7.4B Phi-3 models of the SymphonySMoE paper).

The selected blocks (``model.moe.layers``: every / every_other / a list) get
``model.moe.num_experts`` experts, each the dense FFN plus optional N(0, noise_std) noise; the
router is initialised by its own class (any registered router, seeded per block). Everything
else is copied. With no noise and gates renormalised over the top-k, every MoE layer computes
exactly the dense FFN (sum_k g_k FFN(x) = FFN(x)), so the upcycled model's logits equal the
dense model's (function preservation).

The model is built and written one block at a time, so upcycling a 7B model needs memory for
one block, not the whole model.
"""
from __future__ import annotations

import copy
import time
from typing import Callable, Iterable, Iterator, Optional

import torch

from ..config import Config, ConfigError, apply_overrides, config_from_dict
from ..config.granularity import expand_granularity
from ..errors import UsageError
from ..hf.config import HFModelSpec
from ..hf.dense import DenseCheckpoint
from ..hf.written import write_converted
from ..model import Block, SwiGLU, TransformerLM, build_model
from ..moe import moe_layers

# our model keys that the checkpoint's config.json fixes
ARCHITECTURE_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "rope_theta", "rope_scaling",
                     "norm_eps", "tie_embeddings", "qkv_bias")
_HF_NAMES = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
             "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "d_ff": "intermediate_size",
             "rope_theta": "rope_theta", "rope_scaling": "rope_scaling", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
             "qkv_bias": "model_type (qwen2 has q/k/v biases)"}


def upcycle_config(spec: HFModelSpec, overrides: Iterable[str] = (), base: Optional[dict] = None) -> Config:
    """Our config for the upcycled model: the architecture from config.json, then ``base``
    (e.g. a preset YAML's mapping), then ``KEY=VALUE`` overrides for the MoE, training and data.
    Overrides of the architecture keys are refused: the weights fix them."""
    raw = copy.deepcopy(base or {})
    raw = apply_overrides(raw, overrides)
    model = raw.setdefault("model", {})
    if not isinstance(model, dict):
        raise ConfigError("model: expected a mapping")
    for key in ARCHITECTURE_KEYS:
        if key in model and model[key] != spec.model[key]:
            raise ConfigError(f"model.{key}: {model[key]!r} differs from the checkpoint's {_HF_NAMES[key]} = "
                              f"{spec.model[key]!r}; the dense weights fix it (leave model.{key} out or set it to "
                              f"{spec.model[key]!r})")
        model[key] = spec.model[key]
    moe = model.setdefault("moe", {})
    if not isinstance(moe, dict):
        raise ConfigError("model.moe: expected a mapping")
    sliced = expand_granularity(moe, spec.model["d_ff"]) > 1  # experts are d_ff / G slices (moe.d_ff checked and set)
    if not sliced and moe.get("d_ff") not in (None, spec.model["d_ff"]):
        raise ConfigError(f"model.moe.d_ff: {moe['d_ff']} differs from the dense FFN's intermediate_size="
                          f"{spec.model['d_ff']}; upcycled experts are copies of it (allowed: null or {spec.model['d_ff']}; "
                          "or set model.moe.granularity to split it)")
    if moe.get("activation", "swiglu") != "swiglu":
        raise ConfigError(f"model.moe.activation: {moe['activation']!r}; upcycled experts copy a SwiGLU FFN "
                          "(allowed: 'swiglu')")
    return config_from_dict(raw)


def _check_options(noise_std: float, seed: int) -> None:
    if not (noise_std >= 0 and noise_std == noise_std):
        raise UsageError(f"--noise-std: {noise_std!r}; allowed: a number >= 0")
    if seed < 0:
        raise UsageError(f"--seed: {seed}; allowed: an integer >= 0")


def _block_seed(seed: int, i: int) -> int:
    return seed * 1_000_003 + i


def granularity(cfg: Config) -> int:
    """G of a granular upcycling: the dense FFN's hidden size over the experts' (1: whole copies)."""
    m = cfg.model
    expert_d_ff = m.moe.d_ff or m.d_ff
    if m.d_ff % expert_d_ff or m.moe.num_experts % (m.d_ff // expert_d_ff) or m.moe.top_k % (m.d_ff // expert_d_ff):
        raise ConfigError(f"model.moe.d_ff={expert_d_ff}: upcycled experts are the dense FFN (d_ff={m.d_ff}) or equal "
                          "slices of it, with num_experts and top_k multiples of the number of slices")
    return m.d_ff // expert_d_ff


@torch.no_grad()
def virtual_group_router_(router, groups: int) -> None:
    """Virtual-group initialisation (arXiv 2410.07524): the ``G`` experts of one dense copy
    (experts ``n*G .. n*G+G-1``) get the same router rows, so they score alike and top-(k*G)
    chooses whole copies."""
    for name in router.per_expert_tensors:
        t = getattr(router, name, None)
        if t is not None:
            view = t.view(t.shape[0] // groups, groups, *t.shape[1:])
            view.copy_(view[:, :1].expand_as(view))


@torch.no_grad()
def upcycled_tensors(ckpt: DenseCheckpoint, cfg: Config, noise_std: float = 0.0,
                     seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of the upcycled model's state dict, one block at a time (fp32;
    the tied output projection, if any, is not repeated)."""
    _check_options(noise_std, seed)
    m = cfg.model
    G = granularity(cfg)
    moe_blocks = set(m.moe.layer_indices(m.n_layers))
    yield "embed.weight", ckpt.embedding().float()
    for i in range(m.n_layers):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_block_seed(seed, i))  # the router's own init, reproducible per block
            block = Block(m, i, i in moe_blocks)
        state = ckpt.attention(i)
        gate, up, down = ckpt.ffn(i)
        if block.is_moe:
            block.ffn.experts.load_dense(gate.float(), down.float(), up.float(), noise_std=noise_std,
                                         seed=_block_seed(seed, i), granularity=G)
            if G > 1:
                virtual_group_router_(block.ffn.router, G)
            if block.ffn.shared_expert is not None:  # starts silent: the upcycled model computes the dense function
                block.ffn.shared_expert.w2.weight.zero_()
        else:
            state.update({"ffn.w1.weight": gate, "ffn.w3.weight": up, "ffn.w2.weight": down})
        result = block.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        owned = ("ffn.router.", "ffn.experts.", "ffn.shared_expert.", "ffn.shared_expert_gate.")
        missing = [k for k in result.missing_keys if not k.startswith(owned)]
        if missing or result.unexpected_keys:  # a mapping bug, not a user error
            raise RuntimeError(f"block {i}: weights not mapped {missing}, unexpected {result.unexpected_keys}")
        for name, t in block.state_dict().items():
            yield f"blocks.{i}.{name}", t
    yield "norm.weight", ckpt.final_norm().float()
    head = ckpt.lm_head()
    if head is not None:
        yield "lm_head.weight", head.float()


def upcycle_model(ckpt: DenseCheckpoint, cfg: Config, noise_std: float = 0.0, seed: int = 0) -> TransformerLM:
    """The upcycled model in memory (small models, tests); use :func:`upcycle` for big ones."""
    model = build_model(cfg.model, cfg.model.vocab_size, seed=seed)
    state = dict(upcycled_tensors(ckpt, cfg, noise_std, seed))
    if cfg.model.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    model.load_state_dict(state, strict=True)
    return model


@torch.no_grad()
def preserves_function(cfg: Config, tokens: int = 24, tol: float = 1e-4) -> Optional[bool]:
    """Whether MoE layers with this router setup, all experts equal to one dense FFN, compute
    that FFN (checked numerically on a tiny model in eval mode; None if the check cannot run).
    False means the upcycled model starts from a different function than the dense one
    (e.g. un-normalised gates, a zero-initialised graph, an eval capacity that drops tokens)."""
    small = copy.deepcopy(cfg.model)
    small.d_model, small.n_heads, small.n_kv_heads, small.d_ff, small.n_layers = 16, 2, 1, 24, 2
    small.vocab_size, small.moe.d_ff, small.moe.layers = 64, None, "every"
    small.rope_scaling = None  # sized for the real head; irrelevant to the FFN
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = build_model(small, small.vocab_size, seed=0).eval()
            captured = []
            for layer in moe_layers(model):
                gate, up, down = torch.randn(24, 16) * 0.3, torch.randn(24, 16) * 0.3, torch.randn(16, 24) * 0.3
                layer.experts.load_dense(gate, down, up)
                if layer.shared_expert is not None:  # as upcycling leaves it: silent at first
                    layer.shared_expert.w2.weight.zero_()
                ref = SwiGLU(16, 24, 0.02, 0.02)
                ref.w1.weight.copy_(gate), ref.w3.weight.copy_(up), ref.w2.weight.copy_(down)
                layer.register_forward_hook(lambda mod, inp, out, ref=ref: captured.append((ref(inp[0]), out)))
            model(torch.randint(0, small.vocab_size, (2, tokens // 2)))
    except Exception:  # a router that needs more context than a bare forward gives
        return None
    return all(float((a - b).abs().max()) <= tol * max(float(a.abs().max()), 1e-6) for a, b in captured)


def upcycle(dense_dir: str, out_dir: str, overrides: Iterable[str] = (), *, base: Optional[dict] = None,
            noise_std: float = 0.0, seed: int = 0, dtype: str = "auto", max_shard_bytes: int = 4 << 30,
            log: Callable[[str], None] = print) -> dict:
    """Read ``dense_dir`` (a Hugging Face checkpoint), write the upcycled model to ``out_dir``:
    ``config.yaml`` (our config; train with ``moe-dist train --config out/config.yaml``),
    ``model.safetensors`` (or shards + index), the tokenizer files, ``upcycle.json`` (written last; the
    directory replaces ``out_dir`` only when complete)."""
    t0 = time.perf_counter()
    _check_options(noise_std, seed)
    ckpt = DenseCheckpoint(dense_dir)
    for note in ckpt.spec.notes:
        log(f"note: {note}")
    cfg = upcycle_config(ckpt.spec, overrides, base)
    preserved = None

    def prepare() -> None:
        nonlocal preserved
        preserved = preserves_function(cfg)
        if preserved is False:
            log(f"warning: router {cfg.model.moe.router!r} with options {cfg.model.moe.router_options} does not give "
                "back the dense FFN when all experts are equal, so the upcycled model starts from a different function "
                "(renormalise the gates over the top-k: router_options normalize=true; symphony also init=identity; "
                "and keep model.moe.eval_capacity_factor null)")

    def record(out_dtype: torch.dtype) -> dict:
        return {"moe_layers": cfg.model.moe.layer_indices(cfg.model.n_layers), "num_experts": cfg.model.moe.num_experts,
                "top_k": cfg.model.moe.top_k, "granularity": granularity(cfg), "router": cfg.model.moe.router,
                "noise_std": noise_std, "seed": seed, "preserves_function": preserved}

    info, counts = write_converted("upcycle", dense_dir, "dense checkpoint", out_dir, ckpt, cfg, dtype,
                                   tensors=lambda: upcycled_tensors(ckpt, cfg, noise_std, seed), record=record,
                                   prepare=prepare, max_shard_bytes=max_shard_bytes, log=log, started=t0)
    log(f"upcycled {ckpt.family} ({dense_dir}) -> {out_dir}: {len(info['moe_layers'])} MoE layers x "
        f"{info['num_experts']} experts (top-{info['top_k']}, router {info['router']}), "
        f"{counts['total']:,} parameters ({counts['active']:,} active), {info['dtype']}, "
        f"{info['seconds']:.1f}s")
    return info
