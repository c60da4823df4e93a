"""Named ranges around the host's waits on collectives (and the optimizer step), for the step-time
breakdown.

A blocking collective's wait is not an operator of its own: a profiler sees the call that
enqueues it (``c10d::...``) and, on the backend's thread, the transfer, but not the time the
calling thread spends waiting, which is what the step loses. ``timed_range(kind)`` names that
wait ``moe_dist::<kind>`` while a profiler records (:mod:`moe_dist.train.observe.step_time` reads the
ranges) and costs one flag check otherwise.
"""
from __future__ import annotations

import contextlib

import torch

PREFIX = "moe_dist::"
A2A = "a2a"  # the expert all-to-alls
GRAD_REDUCE = "grad_reduce"  # replicated weights' gradient all-reduce
COLLECTIVE = "collective"  # every other collective of ours (statistics, losses, gradient norms)
OPTIMIZER = "optimizer"  # clipping, the update and the routers' per-step state


def profiling() -> bool:
    """Whether a profiler records on this thread now."""
    return torch._C._autograd._profiler_enabled()


def timed_range(kind: str):
    """A profiler range ``moe_dist::<kind>`` while a profiler records, else nothing."""
    if profiling():
        return torch.autograd.profiler.record_function(PREFIX + kind)
    return contextlib.nullcontext()


def kind_of(collective: str) -> str:
    """The range kind of a collective by its torch name (``all_to_all_single`` -> a2a)."""
    return A2A if collective.startswith(("all_to_all", "alltoall")) else COLLECTIVE
