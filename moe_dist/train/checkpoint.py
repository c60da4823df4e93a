"""Model checkpoints with torch.distributed.checkpoint (DCP), independent of the parallel layout.

Expert weights are stored one entry per *global* expert (``<layer>.experts.w1.expert_5``), so
a checkpoint written at one expert-parallel size loads at any other, and replicas of the
same expert (expert-data-parallel ranks) write it once. Dense weights are saved as they are
(DTensor shards under FSDP2, plain tensors otherwise); DCP reshards them on load.

Layout: ``<run>/checkpoints/step_000100/`` holds the DCP files, ``meta.json`` (step, sampler
position, layout) and a ``COMPLETE`` marker written last. This is the minimum `moe-dist
eval` needs; optimizer state and crash-safe resume build on it.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from ..moe import MoELayer

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes a single process' when torch.distributed is not started: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


def expert_keyed_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each ``[E_local, ...]`` expert tensor replaced by one view per
    global expert. The views share storage with the parameters, so loading into this dict
    loads the model in place."""
    sd = model.state_dict()
    for name, module in model.named_modules():
        if not isinstance(module, MoELayer):
            continue
        experts = module.experts
        for pname in ("w1", "w3", "w2"):
            w = getattr(experts, pname)
            if w is None:
                continue
            key = f"{name}.experts.{pname}" if name else f"experts.{pname}"
            del sd[key]
            for i in range(experts.num_experts):
                sd[f"{key}.expert_{experts.offset + i}"] = w.data[i]
    return sd


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step_{step:06d}")


def save_checkpoint(model: nn.Module, run_dir: str, step: int, meta: dict, is_main: bool) -> str:
    """Collective: every rank calls it. Returns the checkpoint directory."""
    path = step_dir(run_dir, step)
    if is_main:
        os.makedirs(path, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    with _quiet_single_process():
        dcp.save(expert_keyed_state_dict(model), checkpoint_id=path, no_dist=not dist.is_initialized())
    if dist.is_initialized():
        dist.barrier()
    if is_main:
        with open(os.path.join(path, "meta.json"), "w", encoding="utf-8") as f:
            json.dump({"step": step, **meta}, f, indent=2)
        with open(os.path.join(path, COMPLETE), "w") as f:
            f.write("ok\n")
    if dist.is_initialized():
        dist.barrier()
    return path


def latest_checkpoint(run_dir: str) -> Optional[str]:
    """The complete checkpoint with the highest step, or None."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(root, name, COMPLETE)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return max(found)[1] if found else None


def load_checkpoint(model: nn.Module, path: str) -> dict:
    """Load model weights in place (collective under torch.distributed); returns meta.json."""
    if not os.path.exists(os.path.join(path, COMPLETE)):
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {COMPLETE} marker)")
    with _quiet_single_process():
        dcp.load(expert_keyed_state_dict(model), checkpoint_id=path, no_dist=not dist.is_initialized())
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        return json.load(f)
