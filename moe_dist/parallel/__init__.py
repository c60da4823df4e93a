"""Parallelism applied to a model that was defined without it."""
from .expert_parallel import apply_expert_parallel, expert_parameters, dense_parameters
from .grad_sync import sync_gradients

__all__ = ["apply_expert_parallel", "expert_parameters", "dense_parameters", "sync_gradients"]
