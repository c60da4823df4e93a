"""Layout-independent state dicts: the model and the optimizer state keyed by global expert.

* the model: ``model.state_dict()`` names, with each ``[E_local, ...]`` expert tensor replaced
  by one entry per *global* expert (``blocks.0.ffn.experts.w1.expert_5``), so a checkpoint
  written at one expert-parallel size loads at any other; replicas of an expert
  (expert-data-parallel ranks) write it once; split inside over them, each writes its block
  (a DTensor entry). Router state lives in the model's parameters
  and buffers (Symphony's graph, AC running statistics, HyperRouter embedding and frozen
  hypernetwork). Dense weights are kept as they are (DTensor shards under FSDP2, plain
  tensors otherwise); DCP reshards them on load.
* the optimizer: ``optim.<parameter>.<state>`` (AdamW ``step``, ``exp_avg``, ``exp_avg_sq``),
  expert state split and keyed by global expert exactly like the weights
  (``optim.blocks.0.ffn.experts.w1.exp_avg.expert_5``), so it reshards too.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.nn as nn

from ...moe import MoELayer

OPTIM = "optim."
_EXPERT_SUFFIX = re.compile(r"\.expert_(\d+)$")


def expert_layers(model: nn.Module) -> dict[str, MoELayer]:
    """``"<layer>.experts"`` (the experts' state-dict prefix) -> its MoE layer."""
    return {f"{name}.experts" if name else "experts": m for name, m in model.named_modules() if isinstance(m, MoELayer)}


def held_entries(experts, t: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``(global expert, entry)`` for every expert of ``t`` this rank holds. Whole experts are plain
    views; an expert split inside over its replicas (``Shard(d)``, ``d > 0``) is a DTensor view of
    this rank's block on the same mesh (``Shard(d - 1)`` of the expert), so DCP writes every block
    once and reshards on load, under either split and at any number of ranks."""
    views = experts.held(t)
    inner = [p.dim for p in getattr(t, "placements", ()) if type(p).__name__ == "Shard" and p.dim > 0]
    if not inner:
        return views
    from torch.distributed.tensor import DTensor, Shard

    shape = tuple(t.shape[1:])
    stride = tuple(torch.empty(shape, device="meta").stride())
    placements = [Shard(p.dim - 1) if type(p).__name__ == "Shard" else p for p in t.placements]
    return [(g, DTensor.from_local(v, t.device_mesh, placements, run_check=False, shape=shape, stride=stride))
            for g, v in views]


def expert_keyed_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each ``[E_local, ...]`` expert tensor replaced by one view per
    global expert. The views share storage with the parameters, so loading into this dict
    loads the model in place."""
    sd = model.state_dict()
    for prefix, layer in expert_layers(model).items():
        experts = layer.experts
        for pname in ("w1", "w3", "w2"):
            w = getattr(experts, pname)
            if w is None:
                continue
            key = f"{prefix}.{pname}"
            del sd[key]
            for g, view in held_entries(experts, w.data):  # a share of them (or of each) when sharded over edp
                sd[f"{key}.expert_{g}"] = view
    return sd


def _expert_owners(model: nn.Module) -> dict[int, "nn.Module"]:
    """id(expert parameter) -> its GroupedExperts."""
    return {id(p): layer.experts for layer in expert_layers(model).values() for p in layer.experts.expert_parameters()}


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as ``optim.<parameter name>.<state>``; expert state
    (``[E_local, ...]`` like its parameter) as one view per global expert, ``...<state>.expert_<g>``.
    Hyperparameters are not saved: they come from the config (the learning rate from the schedule)."""
    owners = _expert_owners(model)
    out = {}
    for fqn, p in model.named_parameters():
        state = optimizer.state.get(p)
        if not state:
            continue
        experts = owners.get(id(p))
        for name, value in state.items():
            if not torch.is_tensor(value):
                raise TypeError(f"optimizer state {name!r} of {fqn} is a {type(value).__name__}; only tensor state "
                                "can be checkpointed")
            key = f"{OPTIM}{fqn}.{name}"
            if experts is not None and value.dim() > 0:
                if value.shape != p.shape:
                    raise ValueError(f"optimizer state {name!r} of expert parameter {fqn} has shape {list(value.shape)}, "
                                     f"not the parameter's {list(p.shape)}")
                for g, view in held_entries(experts, value):
                    out[f"{key}.expert_{g}"] = view
            else:
                out[key] = value
    return out


def split_optim_key(key: str) -> tuple[str, str, Optional[int]]:
    """``optim.<fqn>.<state>[.expert_<g>]`` -> (fqn, state, g or None)."""
    rest = key[len(OPTIM):]
    m = _EXPERT_SUFFIX.search(rest)
    expert = None
    if m:
        expert, rest = int(m.group(1)), rest[: m.start()]
    fqn, _, state = rest.rpartition(".")
    return fqn, state, expert


def init_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Create (zero) state for the parameters the checkpoint has state for, so DCP can load into it.
    Scalars (AdamW's ``step``) go where the optimizer keeps them: on the CPU unless capturable/fused."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    params = dict(model.named_parameters())
    wanted: dict[str, dict[str, object]] = {}
    for key, md in saved.items():
        if key.startswith(OPTIM):
            fqn, state, _ = split_optim_key(key)
            wanted.setdefault(fqn, {})[state] = md
    for fqn, states in wanted.items():
        p = params.get(fqn)
        if p is None or id(p) not in group_of or optimizer.state.get(p):
            continue
        group = group_of[id(p)]
        new = {}
        for state, md in states.items():
            if len(md.size) == 0:
                device = p.device if group.get("capturable") or group.get("fused") else torch.device("cpu")
                new[state] = torch.zeros((), dtype=md.properties.dtype, device=device)
            else:
                new[state] = torch.zeros_like(p, memory_format=torch.preserve_format)
        optimizer.state[p] = new


def global_keys(model: nn.Module, local: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Every key (with its global shape) the whole model's state has over all ranks: this rank's
    keys with expert keys expanded to every global expert of their layer."""
    totals = {prefix: layer.num_experts for prefix, layer in expert_layers(model).items()}
    out = {}
    for key, t in local.items():
        m = _EXPERT_SUFFIX.search(key)
        base = key[len(OPTIM):] if key.startswith(OPTIM) else key
        total = next((n for prefix, n in totals.items() if base.startswith(prefix + ".")), None) if m else None
        shape = tuple(t.shape)
        if total is None:
            out[key] = shape
        else:
            stem = key[: m.start()]
            for g in range(total):
                out[f"{stem}.expert_{g}"] = shape
    return out

