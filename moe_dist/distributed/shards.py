"""Which part of a (possibly sharded) tensor this rank holds.

FSDP2 shards a parameter along dim 0 (``Shard(0)``) over its mesh; everything else this
project builds is either whole on every rank or an expert-parallel slice that the module
itself describes (``GroupedExperts.offset``). Code that fills or loads weights rank-locally
asks here for the local storage and the global rows it covers, so a rank reads and writes
only what it owns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LocalRows:
    """``local`` is rows ``start .. start + local.shape[0]`` (dim 0) of a tensor of ``global_shape``."""

    local: torch.Tensor
    start: int
    global_shape: tuple[int, ...]

    @property
    def stop(self) -> int:
        return self.start + (self.local.shape[0] if self.local.dim() else 1)


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor")


def local_rows(t: torch.Tensor) -> LocalRows:
    """The local storage of ``t`` and the global dim-0 rows it holds.

    A plain tensor is whole (rows ``0..n``). A DTensor may be replicated or sharded along
    dim 0 on any mesh dimensions; another placement (a dim other than 0, partial sums) is an
    internal error, since nothing in this project creates one."""
    if not is_dtensor(t):
        return LocalRows(t, 0, tuple(t.shape))
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0)):
            raise RuntimeError(f"local_rows: internal error: placement {t.placements} is neither Shard(0) nor "
                               "Replicate (nothing in moe_dist shards a tensor otherwise)")
    with torch.device("cpu"):  # shapes and offsets are host bookkeeping, whatever the default device
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t._local_tensor  # the storage itself (to_local() may return an autograd view)
    if tuple(local.shape) != tuple(shape):  # FSDP2 keeps padded storage only outside the parameter view
        local = local[: shape[0]] if local.dim() else local
    return LocalRows(local, int(offset[0]) if len(offset) else 0, tuple(t.shape))


def copy_rows_(target: torch.Tensor, full_or_rows: torch.Tensor, start: int = 0) -> None:
    """Copy into ``target``'s local part from ``full_or_rows``, which holds global rows
    ``start ..`` (``start=0`` and the whole tensor, or exactly the local rows)."""
    part = local_rows(target)
    lo, hi = part.start - start, part.stop - start
    src = full_or_rows if full_or_rows.dim() == 0 else full_or_rows[lo:hi]
    part.local.copy_(src.to(device=part.local.device, dtype=part.local.dtype))
