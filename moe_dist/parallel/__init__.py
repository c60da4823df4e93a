"""Parallelism applied to a model that was defined without it: expert parallelism
(:mod:`.expert_parallel`, :mod:`.expert_shard`), FSDP2 or replicated dense weights and the whole
model's placement (:mod:`.parallelize`), gradient sync (:mod:`.grad_sync`). The meshes, groups,
collectives and rendezvous they use are :mod:`moe_dist.distributed`."""
from .expert_parallel import apply_expert_parallel, expert_parameters, dense_parameters
from .grad_sync import sync_gradients

__all__ = ["apply_expert_parallel", "expert_parameters", "dense_parameters", "sync_gradients"]
