"""Sort-based token dispatch and combine, with expert parallelism over an all-to-all.

No one-hot ``[tokens, experts, capacity]`` masks and no capacity padding: kept
token-expert pairs are sorted by expert, only those rows cross the wire
(``all_to_all_single`` with uneven splits after a count exchange), computed per local
expert segment as they arrive, sent back and summed into their tokens weighted by the gates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..dist.collectives import all_to_all_rows, group_size
from .counting import count_values


@dataclass
class DispatchPlan:
    token_idx: torch.Tensor  # [N] source token of each sorted kept pair
    gates: torch.Tensor  # [N] gate of each sorted kept pair (gradient)
    send_splits: list  # rows sent to each ep rank
    recv_splits: list  # rows received from each ep rank
    local_counts: list  # rows per local expert
    segments: Optional[list] = None  # (local expert, rows) of the received rows in order (ep > 1)
    read_along: Optional[list] = None  # host values of the caller's ``read_along`` tensor


_BLOCK_ROWS = 4096  # rows per temporary: small temporaries are recycled, big ones page-fault


class _WeightedScatter(torch.autograd.Function):
    """``out[token_idx[i]] += gate[i] * y[i]`` into a zero ``[num_tokens, d]`` output, all in
    ``y``'s dtype. The gate products are formed block by block (no ``[N, d]`` temporary);
    the backward gathers the output gradient once and reuses that buffer for the rows'
    gradient."""

    @staticmethod
    def forward(ctx, y, gate, token_idx, num_tokens):
        ctx.save_for_backward(y, gate, token_idx)
        out = y.new_zeros((num_tokens, y.shape[1]))
        for s in range(0, y.shape[0], _BLOCK_ROWS):
            t = s + _BLOCK_ROWS
            out.index_add_(0, token_idx[s:t], y[s:t] * gate[s:t].unsqueeze(1))
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        y, gate, token_idx = ctx.saved_tensors
        g_rows = grad.contiguous().index_select(0, token_idx)
        g_gate = None
        if ctx.needs_input_grad[1]:
            g_gate = torch.cat([(g_rows[s : s + _BLOCK_ROWS] * y[s : s + _BLOCK_ROWS]).sum(1)
                                for s in range(0, y.shape[0], _BLOCK_ROWS)]) if y.shape[0] else gate.new_zeros(0)
        g_y = g_rows.mul_(gate.unsqueeze(1)) if ctx.needs_input_grad[0] else None
        return g_y, g_gate, None, None


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


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor, keep: Optional[torch.Tensor],
             num_experts: int, ep_group: Optional[dist.ProcessGroup],
             peer_counts: Optional[torch.Tensor] = None,
             read_along: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, DispatchPlan]:
    """Route rows of ``x`` ``[T, d]`` to their experts. Returns the rows this rank's experts
    compute: grouped by local expert, or with expert parallelism in arrival order
    (``plan.segments``).

    ``peer_counts``: ``[ep, E]`` kept pairs per expert of every expert-parallel peer (in
    ``ep_group`` rank order) when the caller knows them already; else they are exchanged.
    ``read_along``: small integer tensor the caller wants on the host too; it rides on the
    dispatch's single host read and comes back as ``plan.read_along`` (a list of ints).

    Host synchronisation: exactly one read (the row counts the all-to-all and the expert
    kernels need, plus ``read_along``), none in backward.
    """
    top_k = expert_ids.shape[1]
    flat_e = expert_ids.reshape(-1)
    flat_g = gates.reshape(-1)
    # dropped pairs get the key E and sort after every expert; kept pairs come out grouped by
    # expert, in token order within an expert (stable sort of the token-major flattening)
    key = flat_e if keep is None else torch.where(keep.reshape(-1), flat_e, num_experts)
    order = torch.argsort(key, stable=True)
    counts = count_values(key, num_experts + 1)[:num_experts]  # kept pairs per expert
    extra = [] if read_along is None else [read_along]
    ep = group_size(ep_group)
    if ep == 1:
        lc, *along = read_counts([counts] + extra)
        order = order[:sum(lc)]
        token_idx = torch.div(order, top_k, rounding_mode="floor")
        routed = x.index_select(0, token_idx)
        plan = DispatchPlan(token_idx, flat_g.index_select(0, order), [routed.shape[0]], [routed.shape[0]], lc,
                            read_along=along[0] if along else None)
        return routed, plan
    local = num_experts // ep
    send_counts = counts.view(ep, local)
    if peer_counts is None:
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=ep_group)  # count exchange first
    else:  # [source peer, my local expert]
        me = dist.get_rank(ep_group)
        recv_counts = peer_counts.to(device=counts.device, dtype=counts.dtype).view(ep, ep, local)[:, me].contiguous()
    sent, received_counts, *along = read_counts([send_counts, recv_counts] + extra)
    send_splits = [sum(sent[r * local:(r + 1) * local]) for r in range(ep)]
    rc = [received_counts[r * local:(r + 1) * local] for r in range(ep)]
    recv_splits = [sum(row) for row in rc]
    order = order[:sum(send_splits)]
    token_idx = torch.div(order, top_k, rounding_mode="floor")
    routed = x.index_select(0, token_idx)
    received = all_to_all_rows(routed, recv_splits, send_splits, ep_group)  # [src rank][local expert] order
    # left in arrival order: the experts run each (source, expert) segment where it is (no
    # regrouping copy of every row, and of its gradient, for the loop kernel)
    segments = [(e, rc[src][e]) for src in range(ep) for e in range(local)]
    plan = DispatchPlan(token_idx, flat_g.index_select(0, order), send_splits, recv_splits,
                        [sum(rc[src][e] for src in range(ep)) for e in range(local)], segments,
                        read_along=along[0] if along else None)
    return received, plan


def combine(y: torch.Tensor, plan: DispatchPlan, num_tokens: int, ep_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Send expert outputs back and sum them into their tokens weighted by the gates.

    The gate multiply happens in the experts' dtype (no fp32 ``[k, T, d]`` temporaries).
    Dropped pairs contribute nothing.
    """
    if plan.segments is not None:
        y = all_to_all_rows(y, plan.send_splits, plan.recv_splits, ep_group)
    return _WeightedScatter.apply(y, plan.gates.to(y.dtype), plan.token_idx, num_tokens)
