"""Whether a dry run's routing model stands in for the layer's device reads.

Under a dry run (``moe-dist plan --dry-run``) tensors are fake: they have shapes but no values,
so the few host reads that size a tensor (the dispatch's counts, the ranks' token counts) take
their values from the :class:`~moe_dist.moe.routing_model.RoutingModel` set here instead.
Outside a dry run nothing is set and every read goes to the device as usual.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

_active = None


def active():
    """The routing model in force (a dry run), or None."""
    return _active


@contextlib.contextmanager
def stand_in(model) -> Iterator[object]:
    """Let ``model`` answer the layer's size-deciding reads while the block runs."""
    global _active
    previous, _active = _active, model
    try:
        yield model
    finally:
        _active = previous
