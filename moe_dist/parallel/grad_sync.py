"""Gradient reduction for the 'loss shares' convention (see moe_dist.moe.routing.losses).

Each rank's loss is its share of the global loss, so gradients are *summed*: dense
parameters over every data-parallel rank, expert parameters over the ranks holding the
same experts (the expert-data-parallel group). Tokens from every rank already reached
the experts through the all-to-all, so that sum is complete.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed.collectives import group_size
from ..distributed.groups import ParallelGroups
from ..distributed.ranges import GRAD_REDUCE, timed_range
from .expert_parallel import dense_parameters, expert_parameters


def _sum_flat(params: Iterable[nn.Parameter], group: Optional[dist.ProcessGroup]) -> None:
    params = [p for p in params if p.requires_grad]
    if group_size(group) == 1 or not params:
        return
    for p in params:  # a rank whose experts saw no token still takes part
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group_params in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group_params])
        with timed_range(GRAD_REDUCE):
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        off = 0
        for p in group_params:
            n = p.grad.numel()
            p.grad.copy_(flat[off : off + n].view_as(p.grad))
            off += n


def sync_gradients(model: nn.Module, groups: ParallelGroups) -> None:
    """Sum gradients: dense over ``groups.dp``, experts over ``groups.edp``."""
    _sum_flat(dense_parameters(model), groups.dp)
    _sum_flat(expert_parameters(model), groups.edp)
