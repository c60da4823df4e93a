"""Expert parallelism: keep this rank's slice of every MoE layer's experts (only a shape change
on a model built on the meta device).

Experts keep their global index (``GroupedExperts.offset``), so the full model's
initialisation, and checkpoints addressed by global expert, do not depend on the layout.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..distributed.groups import ParallelGroups
from ..moe.experts import GroupedExperts
from ..moe.layer import MoELayer, moe_layers


@torch.no_grad()
def _slice_experts(experts: GroupedExperts, start: int, count: int) -> None:
    """Keep experts ``start .. start+count`` (local indices). On the meta device this only changes
    shapes: the slice is allocated later, alone (moe_dist.model.init.materialize)."""
    for name in ("w1", "w3", "w2"):
        w = getattr(experts, name)
        if w is not None:
            kept = (torch.empty((count,) + tuple(w.shape[1:]), dtype=w.dtype, device="meta") if w.is_meta
                    else w[start : start + count].clone())
            setattr(experts, name, nn.Parameter(kept, requires_grad=w.requires_grad))
    experts.num_experts, experts.offset = count, experts.offset + start


def apply_expert_parallel(model: nn.Module, groups: ParallelGroups) -> nn.Module:
    """Give every MoE layer its process groups and keep only the local experts (in place)."""
    for layer in moe_layers(model):
        layer.set_groups(groups)
        if layer.experts.num_experts != layer.num_experts:
            raise ValueError("expert parallelism was already applied to this model")
        local = layer.num_experts // groups.ep_size
        _slice_experts(layer.experts, groups.ep_rank * local, local)
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters that live on a subset of ranks (reduced over the expert-data-parallel group)."""
    return [p for m in model.modules() if isinstance(m, GroupedExperts) for p in m.expert_parameters()]


def dense_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters replicated on every rank (reduced over all data-parallel ranks)."""
    experts = {id(p) for p in expert_parameters(model)}
    return [p for p in model.parameters() if id(p) not in experts]
