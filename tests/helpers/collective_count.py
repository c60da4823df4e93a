"""Record every torch.distributed collective a block of code issues (name, element count,
dtype), to show which collectives a router adds to an MoE layer."""
from __future__ import annotations

import contextlib

import torch.distributed as dist

import moe_dist.distributed.collectives as collectives

NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_to_all_single", "all_to_all",
         "broadcast", "reduce_scatter", "reduce_scatter_tensor", "reduce", "gather", "scatter", "barrier",
         "all_gather_object", "broadcast_object_list")


@contextlib.contextmanager
def record_collectives():
    """Yields a list that fills with ``(name, numel, dtype)`` per collective call."""
    calls: list[tuple[str, int, str]] = []

    def wrap(name, fn):
        def counted(*args, **kwargs):
            t = args[0] if args and hasattr(args[0], "numel") else None
            calls.append((name, t.numel() if t is not None else -1, str(t.dtype) if t is not None else ""))
            return fn(*args, **kwargs)
        return counted

    saved = {n: getattr(dist, n) for n in NAMES if hasattr(dist, n)}
    saved_single = collectives._all_gather_single
    try:
        for n, fn in saved.items():
            setattr(dist, n, wrap(n, fn))
        collectives._all_gather_single = wrap("all_gather_single", saved_single)
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
        collectives._all_gather_single = saved_single
