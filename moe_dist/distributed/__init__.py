"""Meshes, process groups, collectives and rendezvous (device-agnostic): how the ranks find and talk
to each other. Applying parallelism to a model (expert parallelism, FSDP2, gradient sync) is
:mod:`moe_dist.parallel`; the MoE layer's token exchange is :mod:`moe_dist.moe.dispatch`."""
from .collectives import all_reduce_sum, all_gather_tensor, all_to_all_rows, group_rank, group_size
from .groups import ParallelGroups, build_parallel_groups

__all__ = [
    "ParallelGroups",
    "build_parallel_groups",
    "all_reduce_sum",
    "all_gather_tensor",
    "all_to_all_rows",
    "group_rank",
    "group_size",
]
