"""Collectives with a no-op path for a single process, and an autograd all-to-all.

Every helper accepts ``group=None`` when torch.distributed is not initialised (or the
caller wants local behaviour) and then returns its input unchanged, so layer code has a
single path.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .ranges import A2A, COLLECTIVE, timed_range


def _active(group: Optional[dist.ProcessGroup]) -> bool:
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group) if _active(group) else 1


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_rank(group) if _active(group) else 0


def all_reduce_sum(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Sum ``t`` over ``group`` (out of place, no gradient)."""
    if not _active(group):
        return t
    out = t.detach().clone()
    with timed_range(COLLECTIVE):
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


# torch >= 2.13 names it all_gather_single; older releases all_gather_into_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_tensor(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Stack ``t`` (same shape on every rank) from every rank: ``[R, *t.shape]``, no gradient."""
    if not _active(group):
        return t.detach().unsqueeze(0)
    t = t.detach().contiguous()
    out = torch.empty(group_size(group) * t.numel(), dtype=t.dtype, device=t.device)
    with timed_range(COLLECTIVE):
        _all_gather_single(out, t.view(-1), group=group)
    return out.view((group_size(group),) + tuple(t.shape))


def subgroup_positions(group: Optional[dist.ProcessGroup], subgroup: Optional[dist.ProcessGroup]) -> Optional[list[int]]:
    """The rank in ``group`` of each member of ``subgroup``, in ``subgroup`` rank order (this rank's
    alone without a subgroup); None when a member of ``subgroup`` is not in ``group``."""
    if not _active(subgroup):
        return [group_rank(group)]
    if not _active(group):
        return None
    try:
        return [dist.get_group_rank(group, dist.get_global_rank(subgroup, i)) for i in range(group_size(subgroup))]
    except (ValueError, RuntimeError):
        return None


def subgroup_rows(gathered: torch.Tensor, group: Optional[dist.ProcessGroup],
                  subgroup: Optional[dist.ProcessGroup]) -> Optional[torch.Tensor]:
    """The rows of ``gathered`` (``[R, ...]`` from :func:`all_gather_tensor` over ``group``) that
    belong to the members of ``subgroup``, in ``subgroup`` rank order; None when a member of
    ``subgroup`` is not in ``group``."""
    idx = subgroup_positions(group, subgroup)
    if idx is None:
        return None
    if idx == list(range(idx[0], idx[0] + len(idx))):  # consecutive ranks: a view, no index tensor to copy over
        return gathered[idx[0] : idx[0] + len(idx)]
    return gathered[idx]


class _AllToAllRows(torch.autograd.Function):
    """Differentiable ``all_to_all_single`` over rows with uneven splits.

    Backward sends the gradient back along the same routes (splits swapped).
    """

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        with timed_range(A2A):
            dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        with timed_range(A2A):
            dist.all_to_all_single(out, grad, ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def all_to_all_rows(
    x: torch.Tensor,
    out_splits: Sequence[int],
    in_splits: Sequence[int],
    group: Optional[dist.ProcessGroup],
) -> torch.Tensor:
    """Send ``in_splits[j]`` leading rows of ``x`` to rank ``j``; receive ``out_splits[j]`` from it."""
    if not _active(group):
        return x
    if torch.is_grad_enabled() and not x.requires_grad:
        # every rank must run the backward all-to-all, even one whose rows need no gradient
        x = x.detach().requires_grad_()
    return _AllToAllRows.apply(x, list(out_splits), list(in_splits), group)
