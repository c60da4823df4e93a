"""Which part of a (possibly sharded) tensor this rank holds.

FSDP2 shards a parameter along one dimension over its mesh: dense weights along dim 0
(``Shard(0)``), expert weights along dim 0 or along a dimension inside every expert
(:mod:`moe_dist.parallel.expert_shard`). Everything else this project builds is either whole
on every rank or an expert-parallel slice that the module itself describes
(``GroupedExperts.offset``). Code that fills or loads weights rank-locally asks here for the
local storage and the global block it covers, so a rank reads and writes only what it owns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LocalRows:
    """``local`` is the block of a tensor of ``global_shape`` that starts at ``offsets`` (one
    global offset per dimension); ``start`` / ``stop`` are its rows (dim 0)."""

    local: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]

    @property
    def start(self) -> int:
        return self.offsets[0] if self.offsets else 0

    @property
    def stop(self) -> int:
        return self.start + (self.local.shape[0] if self.local.dim() else 1)

    @property
    def within(self) -> tuple[slice, ...]:
        """The block's extent in every dimension after the first (whole dimensions included)."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets[1:], self.local.shape[1:]))

    @property
    def whole_rows(self) -> bool:
        """Whether the block holds whole rows (split, if at all, along dim 0 only)."""
        return tuple(self.local.shape[1:]) == tuple(self.global_shape[1:])


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" or hasattr(t, "_local_tensor")


def local_rows(t: torch.Tensor) -> LocalRows:
    """The local storage of ``t`` and the global block it holds.

    A plain tensor is whole. A DTensor may be replicated or sharded (``Shard(d)``, any ``d``) on
    any mesh dimensions; partial sums are an internal error, since nothing in this project
    creates one."""
    if not is_dtensor(t):
        return LocalRows(t, (0,) * t.dim(), tuple(t.shape))
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for p in t.placements:
        if not isinstance(p, (Replicate, Shard)):
            raise RuntimeError(f"local_rows: internal error: placement {t.placements} is neither Shard nor "
                               "Replicate (nothing in moe_dist makes partial sums)")
    with torch.device("cpu"):  # shapes and offsets are host bookkeeping, whatever the default device
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t._local_tensor  # the storage itself (to_local() may return an autograd view)
    if tuple(local.shape) != tuple(shape):  # FSDP2 keeps padded storage only outside the parameter view
        local = local[tuple(slice(0, n) for n in shape)]
    return LocalRows(local, tuple(int(o) for o in offset), tuple(t.shape))


def copy_rows_(target: torch.Tensor, full_or_rows: torch.Tensor, start: int = 0) -> None:
    """Copy into ``target``'s local block from ``full_or_rows``, which holds global rows
    ``start ..`` and whole further dimensions (``start=0`` and the whole tensor, or exactly the
    local rows)."""
    part = local_rows(target)
    lo, hi = part.start - start, part.stop - start
    src = full_or_rows if full_or_rows.dim() == 0 else full_or_rows[(slice(lo, hi),) + part.within]
    part.local.copy_(src.to(device=part.local.device, dtype=part.local.dtype))
