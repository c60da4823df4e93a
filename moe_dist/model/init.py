"""Filling a model that was built on the meta device, rank-locally and layout-independently.

The trainer builds the model on the meta device (no memory), lets parallelism decide what
each rank holds (expert-parallel slices, FSDP2 shards), allocates only that
(:func:`materialize`) and then fills it: from a checkpoint (each rank reads its own rows) or
here, from random generators keyed by ``(seed, tensor name, global row block)`` and, for
experts, ``(seed, layer, global expert)``. A value therefore depends only on the seed and on
where it sits in the *whole* model, never on how the model is split, so 1, 2 or 4 ranks
start from the same weights and a rank generates only the rows it owns.

Recipes, by module:

* ``nn.Linear`` / ``nn.Embedding`` carrying ``init_std`` (set where the model builds them, the MoE
  layer's shared expert and its gate included): weight ~ N(0, init_std) in blocks of
  :data:`ROW_BLOCK` rows, bias = 0;
* ``RMSNorm`` (block norms, the final norm, attention's q/k norms): ones;
* ``GroupedExperts``: :meth:`~moe_dist.moe.experts.GroupedExperts.reset_parameters` with a
  base seed keyed by the layer's name (one generator per global expert);
* a router (small: ``E x d`` numbers): built fresh on the CPU by its own class under a seed
  keyed by its name, then copied (each rank keeps its shard); its buffers too (the expert bias
  starts at zero).

Any other parameter or buffer is an internal error, so a new module type cannot slip
through uninitialised.
"""
from __future__ import annotations

import hashlib

import torch
import torch.nn as nn

from ..distributed.shards import copy_rows_, local_rows
from ..moe.experts import GroupedExperts
from ..moe.layer import MoELayer
from .layers import RMSNorm

ROW_BLOCK = 256  # rows generated per keyed generator; fixed in global row index, so any shard can start anywhere


def key(seed: int, name: str) -> int:
    """A 63-bit seed for ``name`` under the run's ``seed`` (stable across processes and runs)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def is_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in _tensors(model))


def _tensors(model: nn.Module):
    yield from model.parameters()
    yield from model.buffers()


@torch.no_grad()
def materialize(model: nn.Module, device) -> nn.Module:
    """Allocate (uninitialised) storage for what this rank holds, on ``device``; a model with
    no meta tensors is left as it is (it was built for real)."""
    if not is_meta(model):
        return model
    owners: dict[int, list[tuple[nn.Module, str]]] = {}  # tied parameters: to_empty would untie them
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((module, name))
    model.to_empty(device=torch.device(device))
    for places in owners.values():
        (first, first_name), rest = places[0], places[1:]
        for module, name in rest:
            setattr(module, name, getattr(first, first_name))
    return model


@torch.no_grad()
def normal_rows_(t: torch.Tensor, std: float, seed: int) -> None:
    """Fill this rank's rows of ``t`` with N(0, std^2), row block ``b`` of the whole tensor
    drawn from a generator seeded by ``(seed, b)``."""
    part = local_rows(t)
    if part.local.numel() == 0:
        return
    if not part.whole_rows:  # row blocks are keyed by row: a split inside the rows would need another recipe
        raise RuntimeError(f"normal_rows_: internal error: a tensor split inside its rows ({part.within})")
    total = part.global_shape[0] if part.global_shape else 1
    tail = tuple(part.global_shape[1:])
    for b in range(part.start // ROW_BLOCK, (part.stop - 1) // ROW_BLOCK + 1):
        b0, b1 = b * ROW_BLOCK, min((b + 1) * ROW_BLOCK, total)
        gen = torch.Generator().manual_seed(key(seed, f"rows{b}"))
        block = torch.randn((b1 - b0,) + tail, generator=gen, device=gen.device) * std
        lo, hi = max(b0, part.start), min(b1, part.stop)
        part.local[lo - part.start : hi - part.start].copy_(block[lo - b0 : hi - b0])


@torch.no_grad()
def _copy_router(layer: MoELayer, seed: int) -> list[torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(key(seed, "router"))
        fresh = layer.fresh_router()
    target = dict(layer.router.named_parameters())
    target.update(layer.router.named_buffers())
    source = dict(fresh.named_parameters())
    source.update(fresh.named_buffers())
    if set(target) != set(source):  # a router whose tensors depend on more than its options
        raise RuntimeError(f"router of {type(layer.router).__name__}: fresh copy has tensors {sorted(source)}, "
                           f"the built one {sorted(target)}")
    for name, t in target.items():
        copy_rows_(t, source[name])
    layer.router.frozen_changed()
    return list(target.values())


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter and buffer of ``model`` (this rank's part of each) from ``seed``."""
    done: set[int] = set()
    routers: list[str] = []
    for fqn, module in model.named_modules():
        if any(fqn.startswith(r + ".") for r in routers):
            continue  # a router's submodules: filled with the router
        own = [t for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
               if id(t) not in done]
        if isinstance(module, MoELayer):
            routers.append(f"{fqn}.router" if fqn else "router")
            done.update(id(t) for t in _copy_router(module, key(seed, routers[-1])))
            continue
        if not own:
            continue
        if isinstance(module, GroupedExperts):
            module.reset_parameters(key(seed, fqn) % (2**31 - 1))
        elif isinstance(module, RMSNorm):
            local_rows(module.weight).local.fill_(1.0)
        elif isinstance(module, (nn.Linear, nn.Embedding)) and hasattr(module, "init_std"):
            normal_rows_(module.weight, module.init_std, key(seed, f"{fqn}.weight"))
            if getattr(module, "bias", None) is not None:
                local_rows(module.bias).local.zero_()
        else:
            raise RuntimeError(f"init_weights: no initialisation recipe for {fqn or 'the model'} "
                               f"({type(module).__name__}); add one in moe_dist/model/init.py")
        done.update(id(t) for t in own)
    names = {id(t): n for n, t in model.state_dict(keep_vars=True).items()}
    left = [names.get(id(t), "?") for t in _tensors(model) if id(t) not in done]
    if left:
        raise RuntimeError(f"init_weights: tensors without a recipe: {left[:8]}")
