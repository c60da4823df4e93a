"""Sort-based token dispatch and combine.

No one-hot ``[tokens, experts, capacity]`` masks and no capacity padding: kept
token-expert pairs are sorted by expert and gathered once. With expert parallelism they are
sorted into *send order* (the rows for every other rank in rank order, this rank's own last)
and an :class:`~moe_dist.moe.exchange.Exchange` says where they travel; the experts exchange
and compute them (:mod:`moe_dist.moe.exchange`) and hand back outputs in the same order, which
the combine sums into their tokens weighted by the gates.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..distributed.collectives import group_rank, group_size
from .counting import count_values
from .exchange import Exchange
from .traffic import COUNTS, TrafficMeter


@dataclass
class DispatchPlan:
    token_idx: torch.Tensor  # [N] source token of each sorted kept pair
    gates: torch.Tensor  # [N] gate of each sorted kept pair (gradient)
    local_counts: list  # rows per local expert (received from every rank, this one included)
    exchange: Optional[Exchange] = None  # where the rows travel (expert parallelism), else None
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


def send_order_key(expert: torch.Tensor, num_experts: int, ep: int, rank: int) -> torch.Tensor:
    """Sort key of each pair's expert (``num_experts`` for a dropped pair, which keeps it) for the
    send order: the experts of the other ranks in rank order, then this rank's own."""
    local = num_experts // ep
    lo, hi = rank * local, (rank + 1) * local
    own = (expert >= lo) & (expert < hi)
    key = torch.where(own, expert + (num_experts - hi), torch.where(expert >= hi, expert - local, expert))
    return torch.where(expert == num_experts, expert, key)


def dispatch(x: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor, keep: Optional[torch.Tensor],
             num_experts: int, ep_group: Optional[dist.ProcessGroup],
             peer_counts: Optional[torch.Tensor] = None,
             read_along: Optional[torch.Tensor] = None,
             meter: Optional[TrafficMeter] = None) -> tuple[torch.Tensor, DispatchPlan]:
    """Gather the kept rows of ``x`` ``[T, d]`` for their experts: grouped by expert, or with
    expert parallelism in send order (``plan.exchange`` says where they travel).

    ``peer_counts``: ``[ep, E]`` kept pairs per expert of every expert-parallel peer (in
    ``ep_group`` rank order) when the caller knows them already; else they are exchanged.
    ``read_along``: small integer tensor the caller wants on the host too; it rides on the
    dispatch's single host read and comes back as ``plan.read_along`` (a list of ints).
    ``meter``: records the bytes of the count exchange and, through ``plan.exchange``, of the rows'
    transfers (:mod:`moe_dist.moe.traffic`).

    Host synchronisation: exactly one read (the row counts the all-to-all and the expert
    kernels need, plus ``read_along``), none in backward.
    """
    top_k = expert_ids.shape[1]
    flat_e = expert_ids.reshape(-1)
    flat_g = gates.reshape(-1)
    ep = group_size(ep_group)
    # dropped pairs get the key E and sort after every expert; kept pairs come out grouped by
    # expert (in send order with expert parallelism), in token order within an expert
    kept = flat_e if keep is None else torch.where(keep.reshape(-1), flat_e, num_experts)
    counts = count_values(kept, num_experts + 1)[:num_experts]  # kept pairs per expert
    extra = [] if read_along is None else [read_along]
    if ep == 1:
        order = torch.argsort(kept, stable=True)
        lc, *along = read_counts([counts] + extra)
        order = order[:sum(lc)]
        token_idx = torch.div(order, top_k, rounding_mode="floor")
        plan = DispatchPlan(token_idx, flat_g.index_select(0, order), lc, read_along=along[0] if along else None)
        return x.index_select(0, token_idx), plan
    me = group_rank(ep_group)
    order = torch.argsort(send_order_key(kept, num_experts, ep, me), stable=True)
    local = num_experts // ep
    send_counts = counts.view(ep, local)
    if peer_counts is None:
        recv_counts = torch.empty_like(send_counts)
        if meter is not None:
            meter.record(COUNTS, [1] * ep, send_counts)  # one row of E/ep counts to every peer
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=ep_group)  # count exchange first
    else:  # [source peer, my local expert]
        recv_counts = peer_counts.to(device=counts.device, dtype=counts.dtype).view(ep, ep, local)[:, me].contiguous()
    sent, received_counts, *along = read_counts([send_counts, recv_counts] + extra)
    send = [sum(sent[r * local:(r + 1) * local]) for r in range(ep)]
    recv = [received_counts[r * local:(r + 1) * local] for r in range(ep)]
    order = order[:sum(send)]
    token_idx = torch.div(order, top_k, rounding_mode="floor")
    plan = DispatchPlan(token_idx, flat_g.index_select(0, order), [sum(row[e] for row in recv) for e in range(local)],
                        Exchange(ep_group, me, send, recv, meter), read_along=along[0] if along else None)
    return x.index_select(0, token_idx), plan


def combine(y: torch.Tensor, plan: DispatchPlan, num_tokens: int) -> torch.Tensor:
    """Sum the expert outputs ``y`` (in the dispatch's row order) into their tokens, weighted by
    the gates. The gate multiply happens in the experts' dtype (no fp32 ``[k, T, d]``
    temporaries). Dropped pairs contribute nothing."""
    return _WeightedScatter.apply(y, plan.gates.to(y.dtype), plan.token_idx, num_tokens)
