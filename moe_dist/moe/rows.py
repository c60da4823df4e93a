"""Row helpers of the MoE dispatch: gathering rows, summing them into their tokens, permuting
them (each with its backward), and the forward's one host read.

Both dispatchers (:mod:`~moe_dist.moe.dispatch.flat`, :mod:`~moe_dist.moe.dispatch.hierarchical`) and
the experts build on these; nothing here knows of routing, experts or process groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.autograd.function import once_differentiable


def host_ints(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small tensor of host integers on ``device`` without a host synchronisation: on an
    accelerator ``torch.tensor(values, device=...)`` copies from pageable memory and waits for the
    stream, so the values go through pinned memory with a non-blocking copy instead."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, device="cpu", pin_memory=True).to(device, non_blocking=True)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


class PermuteRows(torch.autograd.Function):
    """``x[perm]`` whose backward is the gather by the inverse permutation (autograd's
    ``index_select`` backward would zero-fill and scatter-add instead)."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


@dataclass(frozen=True, eq=False)
class SumOrder:
    """The order in which the rows that land on one output row are added: ``order`` lists the rows
    in the order they are added (None: row order); with ``slots > 1`` each row first goes into the
    partial sum ``slot[row]`` of its output row (a zero start), and the partials are then added in
    slot order. Rows that land on one output row must add in the same order whatever their layout."""

    order: Optional[torch.Tensor] = None
    slot: Optional[torch.Tensor] = None
    slots: int = 1


ROW_ORDER = SumOrder()


_BLOCK_ROWS = 4096  # rows per temporary: small temporaries are recycled, big ones page-fault


def sum_rows(rows: torch.Tensor, index: torch.Tensor, n: int, how: SumOrder = ROW_ORDER,
             gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[index[i]] += [gate[i] *] rows[i]`` into a zero ``[n, d]`` output, in ``rows``' dtype,
    the additions in the order ``how`` says. The gate products are formed block by block (no
    ``[N, d]`` temporary)."""
    target = index if how.slot is None else how.slot * n + index
    out = rows.new_zeros((how.slots * n, rows.shape[1]))
    for s in range(0, rows.shape[0], _BLOCK_ROWS):
        pick = slice(s, s + _BLOCK_ROWS) if how.order is None else how.order[s:s + _BLOCK_ROWS]
        part = rows[pick] if gate is None else rows[pick] * gate[pick].unsqueeze(1)
        out.index_add_(0, target[pick], part)
    if how.slots == 1:
        return out
    total = out[:n] + out[n:2 * n]
    for s in range(2, how.slots):
        total.add_(out[s * n:(s + 1) * n])
    return total


class _Gather(torch.autograd.Function):
    """``x[index]`` whose backward sums the rows' gradients into ``x``'s rows in the order ``how``."""

    @staticmethod
    def forward(ctx, x, index, how):
        ctx.save_for_backward(index)
        ctx.how, ctx.n = how, x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return sum_rows(grad.contiguous(), index, ctx.n, ctx.how), None, None


def gather_rows(x: torch.Tensor, index: torch.Tensor, how: SumOrder = ROW_ORDER) -> torch.Tensor:
    """The rows ``x[index]``; their gradients sum into ``x`` in the order ``how`` (autograd's
    ``index_select`` when that is row order)."""
    return x.index_select(0, index) if how is ROW_ORDER else _Gather.apply(x, index, how)


class _WeightedScatter(torch.autograd.Function):
    """``out[token_idx[i]] += gate[i] * y[i]`` (``gate`` None: ``y[i]``) into a zero
    ``[num_tokens, d]`` output, all in ``y``'s dtype, added in the order ``how``
    (:func:`sum_rows`); the backward gathers the output gradient once and reuses that buffer
    for the rows' gradient."""

    @staticmethod
    def forward(ctx, y, gate, token_idx, num_tokens, how=ROW_ORDER):
        ctx.save_for_backward(y, gate, token_idx)
        return sum_rows(y, token_idx, num_tokens, how, gate)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        y, gate, token_idx = ctx.saved_tensors
        if gate is None:
            return grad.contiguous().index_select(0, token_idx), None, None, None, None
        g_rows = grad.contiguous().index_select(0, token_idx)
        g_gate = None
        if ctx.needs_input_grad[1]:
            g_gate = torch.cat([(g_rows[s : s + _BLOCK_ROWS] * y[s : s + _BLOCK_ROWS]).sum(1)
                                for s in range(0, y.shape[0], _BLOCK_ROWS)]) if y.shape[0] else gate.new_zeros(0)
        g_y = g_rows.mul_(gate.unsqueeze(1)) if ctx.needs_input_grad[0] else None
        return g_y, g_gate, None, None, None


def scatter_rows(y: torch.Tensor, gate: Optional[torch.Tensor], index: torch.Tensor, n: int,
                 how: SumOrder = ROW_ORDER) -> torch.Tensor:
    """``out[index[i]] += [gate[i] *] y[i]`` into a zero ``[n, d]`` output (differentiable), in the
    order ``how``."""
    return _WeightedScatter.apply(y, gate, index, n, how)


def read_counts(parts: Sequence[torch.Tensor]) -> list[list[int]]:
    """The layer forward's one device-to-host read: the integer tensors ``parts`` concatenated
    into one small tensor, read with a single ``tolist()``, split back (each part flattened)."""
    flat = torch.cat([p.reshape(-1).long() for p in parts])
    values = flat.tolist()
    out, pos = [], 0
    for p in parts:
        out.append(values[pos:pos + p.numel()])
        pos += p.numel()
    return out
