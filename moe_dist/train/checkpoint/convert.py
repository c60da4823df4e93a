"""Consolidate a sharded checkpoint into one safetensors file that one process loads without
torch.distributed.

    moe-dist convert --checkpoint runs/x/checkpoints/step_000100 --out runs/x/consolidated

The output directory has the layout ``moe-dist upcycle`` writes, so ``ckpt.init_from``,
``moe-dist export`` and :func:`moe_dist.weights.load_model_weights` read it too:

* ``model.safetensors``: every ``model.state_dict()`` tensor of the whole model (experts as
  ``[num_experts, ...]`` tensors in global order, tied weights under both names), so
  ``build_model(cfg.model, vocab).load_state_dict(safetensors.torch.load_file(...))`` works
  as it is. Its header metadata holds the config (JSON), its SHA-256, the step and the source.
* ``config.yaml``: the run's resolved config (``model.vocab_size`` filled in).
* ``convert.json``: where it came from (checkpoint, step, the layout it was saved at, config
  hash from the manifest) and what was written.

The source is verified (manifest, sizes, checksums, every tensor) like any checkpoint load.
The output is written beside ``--out`` and moved into place when complete
(:class:`~moe_dist.weights.OutputDirectory`, ``convert.json`` written last); a failure leaves
``--out`` as it was. An existing, non-empty ``--out`` is replaced only with ``force``.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch

from ...config import config_from_dict, load_config, save_config
from ...config.load import config_to_dict
from . import (META, CheckpointError, check_model_tensors, config_sha256, latest_checkpoint, load_checkpoint,
                         read_manifest, read_meta)
from ...errors import MissingInputError, UsageError
from ...weights import OutputDirectory

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
WEIGHTS = "model.safetensors"


def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory, or a run directory's latest complete checkpoint."""
    if not os.path.isdir(path):
        raise MissingInputError(f"--checkpoint {path!r}: no such directory")
    if os.path.exists(os.path.join(path, META)) or not os.path.isdir(os.path.join(path, "checkpoints")):
        return path
    found = latest_checkpoint(path)
    if found is None:
        raise MissingInputError(f"--checkpoint {path!r}: the run directory has no complete checkpoint")
    return found


def checkpoint_config(path: str, meta: dict):
    """The config a checkpoint was trained with: meta.json's copy (trainer checkpoints), else the
    run directory's config.yaml (with the vocabulary size from meta.json)."""
    if meta.get("config"):
        return config_from_dict(meta["config"])
    run_config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "config.yaml")
    if not os.path.exists(run_config):
        raise CheckpointError(f"{path}: its meta.json holds no config and {run_config} does not exist")
    cfg = load_config(run_config)
    if cfg.model.vocab_size is None:
        if meta.get("vocab_size") is None:
            raise CheckpointError(f"{run_config}: model.vocab_size is null and {path}/{META} does not record it")
        cfg.model.vocab_size = int(meta["vocab_size"])
    return cfg


def consolidate(checkpoint: str, out_dir: str, dtype: str = "auto", force: bool = False,
                log: Callable[[str], None] = print) -> dict:
    """Write ``out_dir`` (see the module docstring); returns what convert.json records."""
    from ...model import build_model
    from ...model.init import materialize

    if dtype != "auto" and dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r}; allowed: auto, {', '.join(DTYPES)}")
    path = resolve_checkpoint(checkpoint)
    manifest = read_manifest(path)
    meta = read_meta(path)
    output = OutputDirectory(out_dir, "convert", replace_complete=False, force=force)
    with output:
        cfg = checkpoint_config(path, meta)
        cfg.ckpt.init_from, cfg.resume = None, "none"  # the written weights replace both
        # checked against the checkpoint's tensors on the meta device first (a meta.json whose config does not
        # match them is refused before anything is allocated), then allocated but not initialised: every tensor
        # is loaded below (the loaders refuse a missing one)
        model = build_model(cfg.model, cfg.model.vocab_size, device="meta")
        check_model_tensors(path, model)
        model = materialize(model, "cpu")
        load_checkpoint(model, path)  # verifies the files and that every tensor (every expert) is there
        torch_dtype = DTYPES.get(dtype)
        config = config_to_dict(cfg)
        record = {"format": "moe_dist.consolidated", "source": os.path.abspath(path), "step": manifest["step"],
                  "saved_layout": manifest.get("layout"), "source_config_sha256": manifest.get("config_sha256"),
                  "config_sha256": config_sha256(config), "dtype": str(torch_dtype or "as saved").replace("torch.", "")}
        tmp = output.path
        tensors = _write_weights(model, os.path.join(tmp, WEIGHTS), torch_dtype,
                                 {**{k: v if isinstance(v, str) else json.dumps(v) for k, v in record.items()},
                                  "config": json.dumps(config, sort_keys=True), **output.metadata})
        save_config(cfg, os.path.join(tmp, "config.yaml"), home=os.path.abspath(out_dir))
        record.update(tensors=tensors, bytes=os.path.getsize(os.path.join(tmp, WEIGHTS)))
        output.finish(record)
    log(f"consolidated {path} (step {record['step']}, saved by {(record['saved_layout'] or {}).get('world_size', '?')} "
        f"rank(s)) -> {os.path.join(out_dir, WEIGHTS)}: {tensors} tensors, {record['bytes'] / 2**20:.1f} MiB")
    return record


@torch.no_grad()
def _write_weights(model: torch.nn.Module, path: str, dtype: Optional[torch.dtype], metadata: dict) -> int:
    """Every state-dict tensor of the (whole, single-process) model into one safetensors file.
    Tensors that share memory (tied weights) are written under each name as separate copies."""
    from safetensors.torch import save_file

    tensors, seen = {}, set()
    for name, t in model.state_dict().items():
        t = t.detach()
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        t = t.contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    save_file(tensors, path, metadata={"format": "pt", **metadata})
    return len(tensors)
