"""What ``moe-dist plan`` plans: one of our YAML configs or a Hugging Face ``config.json`` (dense
or MoE, a dense one planned as its upcycled MoE when ``model.moe.*`` overrides are given), read
into a :class:`PlanInput`."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, Optional, Union

from ..config import ConfigError, apply_overrides, config_from_dict, load_config
from ..config.granularity import expand_granularity
from ..config.load import read_yaml
from ..hf.config import HFModelSpec, config_path, hf_model_spec, is_hf_config
from ..safe_io import UnreadableFile, read_json

DEFAULT_HF_SEQ_LEN = 4096


@dataclass
class PlanInput:
    """What is planned: the model, its MoE blocks, and the training settings."""

    source: str
    kind: str  # "moe_dist" or "hf:<family>"
    model: object  # moe_dist.config.ModelConfig
    moe_blocks: list[int]
    seq_len: int
    global_batch: Optional[int]
    grad_accum: int
    dtype: str
    dense_mode: str
    configured_ep: Union[int, str, None]  # parallel.ep: a size, "auto" or none
    notes: list[str]
    backend: str = "nccl"  # "gloo" (parallel.backend=gloo) adds the copy its reduce-scatter makes
    reshard_after_forward: bool = True  # FSDP2 gathers the weights again in backward
    configured_dispatch: str = "flat"  # parallel.dispatch
    configured_max_groups: Optional[int] = None  # model.moe.max_groups_per_token (groups of model.moe.router_groups)
    expert_shard: str = "auto"  # parallel.expert_shard: how FSDP2 splits the experts over their replicas
    grad_sync: str = "step"  # parallel.grad_sync: reduce-scatter once per step or after every micro-batch
    eval_batch: Optional[int] = None  # eval.batch (None: a Hugging Face config, which has no training settings)


def _read_mapping(path: str) -> dict:
    if not path.endswith(".json"):
        return read_yaml(path)  # ${config_dir} expanded, as `moe-dist train` reads it
    try:
        raw = read_json(path)
    except UnreadableFile as e:
        raise ConfigError(f"--config: file {path!r} {e.why}") from None
    return raw if isinstance(raw, dict) else {}


def _vocab_of(cfg) -> int:
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    if cfg.data.tokenizer and os.path.isfile(cfg.data.tokenizer):
        from ..data import Tokenizer  # sentencepiece or tokenizer.json

        return Tokenizer.load(cfg.data.tokenizer).vocab_size
    return cfg.data.vocab_size  # the tokenizer the trainer would train


def read_source(path: str) -> tuple[str, dict, bool]:
    """``--config`` as given: (the file read, its mapping, whether it is a Hugging Face config); a
    Hugging Face checkpoint directory is read through its ``config.json``."""
    if os.path.isdir(path):
        path = config_path(path)
    raw = _read_mapping(path)
    return path, raw, path.endswith(".json") or is_hf_config(raw)


def hf_seq_len(raw: dict) -> int:
    """Tokens per sequence planned for a Hugging Face model: 4096, or its context if shorter."""
    return min(DEFAULT_HF_SEQ_LEN, int(raw.get("max_position_embeddings") or DEFAULT_HF_SEQ_LEN))


def hf_config(raw: dict, where: str, overrides: Iterable[str], sections: Optional[dict] = None):
    """(the model's :class:`HFModelSpec`, our Config of it): its model (granular upcycling expanded,
    as `moe-dist upcycle` would write it) with ``sections`` (e.g. ``train``) and the overrides."""
    spec: HFModelSpec = hf_model_spec(raw, where=where)
    ours = apply_overrides({**(sections or {}), "model": json.loads(json.dumps(spec.model))}, list(overrides))
    moe = ours["model"].setdefault("moe", {}) if isinstance(ours.get("model"), dict) else None
    if isinstance(moe, dict):  # granular upcycling: what `moe-dist upcycle` would write
        expand_granularity(moe, spec.model["d_ff"])
    return spec, config_from_dict(ours)


def load_plan_input(path: str, overrides: Iterable[str] = (), seq_len: Optional[int] = None) -> PlanInput:
    overrides = list(overrides)
    path, raw, hf = read_source(path)
    if hf:
        spec, cfg = hf_config(raw, path, overrides)
        plans_moe = spec.is_moe or any(o.split("=", 1)[0].strip().startswith("model.moe.") for o in overrides)
        moe_blocks = cfg.model.moe.layer_indices(cfg.model.n_layers) if plans_moe else []
        return PlanInput(source=path, kind=f"hf:{spec.family}", model=cfg.model, moe_blocks=moe_blocks,
                         seq_len=seq_len or hf_seq_len(raw), global_batch=None, grad_accum=1,
                         dtype="bf16", dense_mode="fsdp", configured_ep=None, notes=list(spec.notes),
                         expert_shard=cfg.parallel.expert_shard, grad_sync=cfg.parallel.grad_sync)
    cfg = load_config(path, overrides)
    cfg.model.vocab_size = _vocab_of(cfg)
    return PlanInput(source=path, kind="moe_dist", model=cfg.model,
                     moe_blocks=cfg.model.moe.layer_indices(cfg.model.n_layers), seq_len=seq_len or cfg.train.seq_len,
                     global_batch=cfg.train.global_batch, grad_accum=cfg.train.grad_accum, dtype=cfg.train.dtype,
                     dense_mode=cfg.parallel.dense, configured_ep=cfg.parallel.ep,
                     backend="gloo" if cfg.parallel.backend == "gloo" else "nccl",
                     reshard_after_forward=cfg.parallel.reshard_after_forward, notes=[],
                     configured_dispatch=cfg.parallel.dispatch, configured_max_groups=cfg.model.moe.max_groups_per_token,
                     expert_shard=cfg.parallel.expert_shard, grad_sync=cfg.parallel.grad_sync, eval_batch=cfg.eval.batch)
