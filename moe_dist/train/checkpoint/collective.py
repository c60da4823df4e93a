"""Small collectives of host objects for checkpointing, with a single-process path.

Every rank calls them; without torch.distributed they act on the one process. A check that
fails on one rank fails on all (:func:`collectively`, :func:`agree`), so no rank is left
waiting in a later collective.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Optional

import torch.distributed as dist

from .files import CheckpointError, DamagedCheckpoint, IncompleteCheckpoint, UnsafeCheckpoint

_KINDS = {"incomplete": IncompleteCheckpoint, "damaged": DamagedCheckpoint, "unsafe": UnsafeCheckpoint,
          "other": CheckpointError}


def _kind(error: CheckpointError) -> str:
    return next(k for k, cls in _KINDS.items() if isinstance(error, cls))


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns that it 'assumes a single process' when torch.distributed is not started: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


def all_gather(obj, group) -> list:
    if not distributed():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def collectively(fn: Callable, group):
    """``fn()`` on every rank; if it raises on any rank, every rank raises, so no rank waits in a later
    collective. The failing rank re-raises its own exception; the others raise a CheckpointError
    with its message when it was one (a refusal the user can act on), else a RuntimeError naming
    the failing rank (an internal error keeps its traceback where it happened)."""
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - reported to every rank
        error = e
    kind = _kind(error) if isinstance(error, CheckpointError) else "internal"
    report = None if error is None else (kind, f"{type(error).__name__}: {error}" if kind == "internal" else str(error))
    reports = [(r, rank) for rank, r in enumerate(all_gather(report, group)) if r]
    if error is not None:
        raise error
    if reports:
        (kind, message), rank = reports[0]
        if kind == "internal":
            raise RuntimeError(f"rank {rank} of the checkpoint group failed: {message}")
        raise _KINDS[kind](message)
    return result


def agree(error: Optional[str], group) -> None:
    """Raise the same CheckpointError on every rank if any rank reports an error."""
    errors = [e for e in all_gather(error, group) if e]
    if errors:
        raise CheckpointError(errors[0] if len(set(errors)) == 1 else " | ".join(dict.fromkeys(errors)))


def barrier(group) -> None:
    if distributed():
        dist.barrier(group=group)


def broadcast(obj, group):
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]
