"""Process groups and the few collectives the MoE code needs (device-agnostic)."""
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
