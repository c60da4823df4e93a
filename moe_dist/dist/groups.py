"""Named process groups for data, expert and expert-data parallelism.

Layout: ``world = dp`` (every rank holds distinct tokens). Expert-parallel groups are
contiguous blocks of ``ep`` ranks (``[0..ep-1], [ep..2ep-1], ...``); the expert-data-
parallel group of a rank is the strided set of ranks that hold the same experts
(``{r % ep + i*ep}``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist


@dataclass
class ParallelGroups:
    """The groups an MoE model needs. ``None`` groups mean 'this process alone'."""

    dp: Optional[dist.ProcessGroup] = None  # ranks holding distinct tokens (router statistics)
    ep: Optional[dist.ProcessGroup] = None  # all-to-all among ranks that split the experts
    edp: Optional[dist.ProcessGroup] = None  # ranks holding the same experts (expert grads)
    ep_size: int = 1
    ep_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    edp_size: int = 1

    @classmethod
    def single(cls) -> "ParallelGroups":
        return cls()


def build_parallel_groups(ep_size: int, num_experts: Optional[int] = None) -> ParallelGroups:
    """Create the groups on an initialised default process group (collective: all ranks call it)."""
    if not (dist.is_available() and dist.is_initialized()):
        if ep_size != 1:
            raise ValueError(f"parallel.ep={ep_size} needs torch.distributed to be initialised (world size 1 allows only ep=1)")
        return ParallelGroups.single()
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"parallel.ep={ep_size} must be >= 1 and divide the world size {world}")
    if num_experts is not None and num_experts % ep_size:
        raise ValueError(f"parallel.ep={ep_size} must divide model.moe.num_experts={num_experts}")
    ep_group = edp_group = None
    for start in range(0, world, ep_size):  # every rank must create every group, in the same order
        g = dist.new_group(list(range(start, start + ep_size)))
        if start <= rank < start + ep_size:
            ep_group = g
    for off in range(ep_size):
        g = dist.new_group(list(range(off, world, ep_size)))
        if rank % ep_size == off:
            edp_group = g
    return ParallelGroups(
        dp=dist.group.WORLD,
        ep=ep_group,
        edp=edp_group,
        ep_size=ep_size,
        ep_rank=rank % ep_size,
        dp_size=world,
        dp_rank=rank,
        edp_size=world // ep_size,
    )
