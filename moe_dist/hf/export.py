"""``moe-dist export``: load one of our models from disk and write it in a Hugging Face format.

``--checkpoint`` accepts
  * a ``moe-dist upcycle`` or ``moe-dist import`` output directory (``config.yaml`` + ``model.safetensors``),
  * a run directory written by ``moe-dist train`` (its latest complete checkpoint), or
  * one checkpoint directory ``<run>/checkpoints/step_NNNNNN``.

The output is written beside ``--out`` and moved into place when complete
(:class:`~moe_dist.weights.OutputDirectory`), ``export.json`` last: what was exported, the
config.json values kept from the source and the notes. When the model came from
``moe-dist import`` or ``upcycle`` (the directory itself, or the ``ckpt.init_from`` of the run
that trained it), config.json keeps the source's :data:`~moe_dist.hf.config.KEPT_KEYS` (token ids, context
length, ``router_aux_loss_coef``), which our config does not hold.
"""
from __future__ import annotations

import os
from typing import Callable, Iterable, Optional

import torch

from ..config import load_config
from .config import KEPT_KEYS, HFFormatError
from ..errors import MissingInputError, UsageError
from ..safe_io import MIB, UnreadableFile, read_json
from ..weights import OutputDirectory, read_record

FORMATS = ("mixtral", "olmoe", "qwen2_moe")  # keys of hf.architectures.MOE_ARCHITECTURES
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _is_step_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, "meta.json")) and os.path.basename(os.path.dirname(path)) == "checkpoints"


def locate(path: str) -> tuple[str, str, str]:
    """``(config.yaml, kind, weights path)`` with kind ``safetensors`` or ``dcp``."""
    from ..train.checkpoint import latest_checkpoint
    from ..weights import has_model_weights

    if not os.path.isdir(path):
        raise MissingInputError(f"--checkpoint {path!r}: no such directory")
    if _is_step_dir(path):
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        return os.path.join(run_dir, "config.yaml"), "dcp", path
    config = os.path.join(path, "config.yaml")
    if not os.path.exists(config):
        raise MissingInputError(f"--checkpoint {path!r} has no config.yaml: expected a `moe-dist upcycle` or `import` "
                                "output, a run directory or a <run>/checkpoints/step_NNNNNN directory")
    step = latest_checkpoint(path)
    if step is not None:
        return config, "dcp", step
    if has_model_weights(path):
        return config, "safetensors", path
    raise MissingInputError(f"--checkpoint {path!r} holds neither model.safetensors nor a complete checkpoint under "
                            f"{os.path.join(path, 'checkpoints')}")


def load_our_model(path: str, overrides: Iterable[str] = ()):
    """``(model, cfg, weights path)``: the full model on one process, weights loaded."""
    from ..model import build_model
    from ..model.init import materialize
    from ..train.checkpoint import META, load_checkpoint, read_meta
    from ..weights import load_model_weights

    config, kind, weights = locate(path)
    cfg = load_config(config, overrides)
    if cfg.model.vocab_size is None:
        vocab = read_meta(weights).get("vocab_size") if os.path.exists(os.path.join(weights, META)) else None
        if vocab is None:
            raise HFFormatError(f"{config}: model.vocab_size is null and the checkpoint does not record it")
        cfg.model.vocab_size = int(vocab)
    cfg.ckpt.init_from = None  # the weights below replace any initialisation
    # allocated but not initialised: every tensor is loaded below (the loaders refuse a missing one)
    model = materialize(build_model(cfg.model, cfg.model.vocab_size, device="meta"), "cpu")
    if kind == "dcp":
        load_checkpoint(model, weights)
    else:
        load_model_weights(model, weights)
    return model.eval(), cfg, weights


def tokenizer_source(path: str, cfg) -> Optional[str]:
    """Where the model's tokenizer files are: the upcycle directory, the data.tokenizer's
    directory, or the run's prepared data directory (run.json)."""
    for directory in (path, os.path.dirname(os.path.abspath(cfg.data.tokenizer)) if cfg.data.tokenizer else None):
        if directory and any(os.path.exists(os.path.join(directory, f)) for f in ("tokenizer.model", "tokenizer.json")):
            return directory
    run_json = os.path.join(path, "run.json")
    if os.path.exists(run_json):
        try:
            run_info = read_json(run_json, 16 * MIB)
        except UnreadableFile as e:
            raise HFFormatError(str(e)) from None
        data = run_info.get("data") if isinstance(run_info, dict) else None
        data_dir = data.get("directory") if isinstance(data, dict) else None
        if isinstance(data_dir, str) and os.path.exists(os.path.join(data_dir, "tokenizer.model")):
            return data_dir
    return None


def source_record(checkpoint: str, overrides: Iterable[str] = ()) -> tuple[Optional[str], dict]:
    """``(directory, record)`` of the import / upcycle the model came from: ``checkpoint`` itself,
    or the ``ckpt.init_from`` of its config (a run trained from one); ``(None, {})`` if neither."""
    config, _, _ = locate(checkpoint)
    candidates = [os.path.dirname(config), load_config(config, overrides).ckpt.init_from]
    for directory in candidates:
        if directory and os.path.isdir(directory):
            writer, record = read_record(directory)
            if writer in ("import", "upcycle"):
                return directory, record
    return None, {}


def kept_from_source(cfg, source: dict) -> tuple[dict, list[str]]:
    """``(config.json values, notes)``: the source's :data:`KEPT_KEYS` where it set them, our
    config's context length and load-balancing coefficient otherwise."""
    kept = {k: source[k] for k in KEPT_KEYS if k in source}
    notes = []
    seq_len, ctx = cfg.train.seq_len, kept.get("max_position_embeddings")
    if ctx is None:
        kept["max_position_embeddings"] = max(seq_len, 4096)
    elif seq_len > ctx:
        notes.append(f"max_position_embeddings={ctx} is the source's; this config's train.seq_len={seq_len} is longer")
    ours = cfg.model.moe.aux_loss_coef
    if "router_aux_loss_coef" not in kept:
        kept["router_aux_loss_coef"] = ours
    elif float(kept["router_aux_loss_coef"]) != float(ours):
        notes.append(f"router_aux_loss_coef={kept['router_aux_loss_coef']!r} is the source's; training here weighed "
                     f"the load-balancing loss with model.moe.aux_loss_coef={ours!r}")
    return kept, notes


def export(checkpoint: str, fmt: str, out_dir: str, dtype: str = "auto", overrides: Iterable[str] = (),
           log: Callable[[str], None] = print) -> dict:
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r}; allowed: {list(FORMATS)}")
    if dtype != "auto" and dtype not in EXPORT_DTYPES:
        raise UsageError(f"--dtype {dtype!r}; allowed: auto, {', '.join(EXPORT_DTYPES)}")
    origin, record = source_record(checkpoint, overrides)
    model, cfg, weights = load_our_model(checkpoint, overrides)
    torch_dtype = EXPORT_DTYPES[dtype] if dtype != "auto" else (torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32)
    from .architectures import MOE_ARCHITECTURES
    from .moe_export import export_moe

    arch = MOE_ARCHITECTURES[fmt]
    src = os.path.dirname(os.path.dirname(os.path.abspath(weights))) if _is_step_dir(weights) else checkpoint
    source = record.get("source_config", {})
    kept, notes = kept_from_source(cfg, source)
    with OutputDirectory(out_dir, "export") as out:
        result = export_moe(model, cfg, out.path, arch, dtype=torch_dtype, tokenizer_dir=tokenizer_source(src, cfg),
                            max_position_embeddings=kept["max_position_embeddings"], kept=kept, metadata=out.metadata,
                            log=log)
        result["notes"] = result["notes"] + notes
        dtype_name = result["config"]["torch_dtype"]
        changed = []
        if record.get("source_dtype") and record["source_dtype"] != dtype_name:
            changed.append({"key": "torch_dtype", "source": record["source_dtype"], "exported": dtype_name,
                            "why": f"--dtype {dtype}" if dtype != "auto" else f"auto: train.dtype={cfg.train.dtype}"})
        out.finish({"checkpoint": os.path.abspath(checkpoint), "weights": os.path.abspath(weights), "format": fmt,
                    "architecture": arch.causal_lm, "dtype": dtype_name, "files": result["files"],
                    "tokenizer_files": result["tokenizer_files"], "source": origin,
                    "kept_from_source": {k: v for k, v in kept.items() if k in source}, "changed": changed,
                    "notes": result["notes"]})
    for note in notes:
        log(f"note: {note}")
    for change in changed:
        log(f"note: {change['key']}: the source's {change['source']!r}, exported {change['exported']!r} ({change['why']})")
    log(f"exported {weights} -> {out_dir} ({arch.display}, {str(torch_dtype).replace('torch.', '')}, "
        f"{result['bytes'] / 2**20:.1f} MiB in {len(result['files'])} file(s); tokenizer files: "
        f"{result['tokenizer_files'] or 'none'})")
    return result
