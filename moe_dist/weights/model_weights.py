"""Our model's weights as safetensors: ``model.state_dict()`` names, experts as whole
``[num_experts, ...]`` tensors indexed by *global* expert.

Because experts are stored by global index, a model that already keeps only its
expert-parallel slice (``GroupedExperts.offset``) reads just its rows, and one file serves
every expert-parallel size. Tied output projections are stored once (``embed.weight``).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn as nn

from ..distributed.shards import copy_rows_, local_rows
from ..errors import HFFormatError, UsageError
from ..moe.experts import GroupedExperts
from ..moe.layer import MoELayer
from .safetensors_io import SafetensorsCheckpoint, ShardedWriter

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STORED_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}  # a checkpoint's dtype name -> ours (else fp32)


def output_dtype(choice: str, stored: Optional[str]) -> torch.dtype:
    """The dtype to write converted weights in: ``choice`` (``auto`` or a :data:`DTYPES` key);
    ``auto`` keeps the source checkpoint's 16-bit dtype ``stored`` (a config.json name such as
    ``bfloat16``), else fp32."""
    if choice == "auto":
        return STORED_DTYPES.get(stored, torch.float32)
    if choice not in DTYPES:
        raise UsageError(f"--dtype: {choice!r}; allowed: auto, {', '.join(DTYPES)}")
    return DTYPES[choice]


def _expert_tensors(model: nn.Module) -> dict[str, GroupedExperts]:
    """state-dict name of every expert weight -> its GroupedExperts module."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            for pname in ("w1", "w3", "w2"):
                if getattr(module, pname) is not None:
                    found[f"{name}.{pname}" if name else pname] = module
    return found


def _global_experts(model: nn.Module) -> dict[int, int]:
    """id(GroupedExperts) -> number of experts of its layer over all ranks."""
    return {id(m.experts): m.num_experts for m in model.modules() if isinstance(m, MoELayer)}


def _aliases(model: nn.Module) -> dict[str, str]:
    """state-dict names that share storage with an earlier name (tied weights) -> that name."""
    first: dict[int, str] = {}
    alias = {}
    for name, t in model.state_dict(keep_vars=True).items():
        key = id(t)
        if key in first:
            alias[name] = first[key]
        else:
            first[key] = name
    return alias


@torch.no_grad()
def save_model_weights(model: nn.Module, directory: str, dtype: Optional[torch.dtype] = None,
                       max_shard_bytes: int = 4 << 30, metadata: Optional[dict] = None) -> list[str]:
    """Write the whole model (all experts must be present: call before expert parallelism)."""
    totals = _global_experts(model)
    for name, experts in _expert_tensors(model).items():
        if experts.num_experts != totals.get(id(experts), experts.num_experts):
            raise ValueError(f"{name}: this model holds {experts.num_experts} of {totals[id(experts)]} experts "
                             "(expert parallelism applied); save the full model")
    aliases = _aliases(model)
    writer = ShardedWriter(directory, max_shard_bytes, metadata={"format_of": "moe_dist", **(metadata or {})})
    for name, t in model.state_dict().items():
        if name in aliases:
            continue
        writer.add(name, t.to(dtype) if dtype is not None and t.is_floating_point() else t)
    return writer.close()


READ_CHUNK_BYTES = 64 << 20


def _read_rows_into(ckpt: SafetensorsCheckpoint, name: str, start: int, out: torch.Tensor,
                    within: tuple[slice, ...] = ()) -> None:
    """Rows ``start ..`` of ``name`` (as many as ``out`` has; of each, the block ``within`` of the
    further dimensions: an expert split inside) into ``out``, about :data:`READ_CHUNK_BYTES` at a
    time: reading the whole slice and then converting it (``.to(fp32)`` of bf16 weights) held both
    copies of the largest tensor at once, the peak of a 1-process load."""
    rows = out.shape[0]
    if rows == 0 or out.numel() == 0:
        return
    step = max(1, READ_CHUNK_BYTES // max(1, out[0].numel() * out.element_size()))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        out[lo:hi].copy_(ckpt.get_rows(name, start + lo, start + hi, within))


@torch.no_grad()
def load_model_weights(model: nn.Module, directory: str) -> dict:
    """Load weights written by :func:`save_model_weights` (or ``moe-dist upcycle``) into ``model``
    in place, converting dtypes. Each rank reads only what it holds: its experts' rows after
    expert parallelism, its block of each FSDP2-sharded (DTensor) weight. Works on a model built
    on the meta device once :func:`moe_dist.model.init.materialize` allocated it. Returns
    ``{"loaded": n_tensors}``."""
    ckpt = SafetensorsCheckpoint(directory)
    state = model.state_dict(keep_vars=True)
    aliases = _aliases(model)
    experts = _expert_tensors(model)
    totals = _global_experts(model)
    wanted = [k for k in state if k not in aliases]
    missing = [k for k in wanted if k not in ckpt]
    unexpected = [k for k in ckpt.keys() if k not in state]
    if missing or unexpected:
        raise HFFormatError(f"{directory}: the weights do not match the model built from the config: "
                            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''} ({len(missing)}), "
                            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''} ({len(unexpected)}); "
                            "was the config changed after the weights were written?")
    for name in wanted:
        target = state[name]
        module = experts.get(name)  # expert weights: whole layer on disk, global expert rows
        if module is not None:
            expected = (totals.get(id(module), module.num_experts),) + tuple(target.shape[1:])
            if ckpt.shape(name) != expected:
                raise HFFormatError(f"{directory}: {name!r} has shape {list(ckpt.shape(name))}, the model expects "
                                    f"{list(expected)} (all experts of the layer)")
        elif ckpt.shape(name) != tuple(target.shape):
            raise HFFormatError(f"{directory}: {name!r} has shape {list(ckpt.shape(name))}, the model expects "
                                f"{list(target.shape)}")
        if target.dim() == 0:
            copy_rows_(target, ckpt.get(name))
        else:  # this rank's block: its FSDP shard, its experts (a share of them, or of each, when sharded over edp)
            part, base = local_rows(target), module.offset if module is not None else 0
            _read_rows_into(ckpt, name, base + part.start, part.local, part.within)
        ckpt.close()  # unmap the file after each tensor: mapped pages read so far count as this process's memory
    ckpt.close()
    return {"loaded": len(wanted)}


def has_model_weights(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, f)) for f in ("model.safetensors", "model.safetensors.index.json"))
