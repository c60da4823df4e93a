"""The flat dispatch: sort-based token dispatch and combine, every pair's row straight to its expert.

No one-hot ``[tokens, experts, capacity]`` masks and no capacity padding: kept
token-expert pairs are sorted by expert and gathered once. With expert parallelism they are
sorted into *send order* (the rows for every other rank in rank order, this rank's own last)
and an :class:`~moe_dist.moe.dispatch.exchange.Exchange` says where they travel; the experts exchange
and compute them (:mod:`moe_dist.moe.dispatch.exchange`) and hand back outputs in the same order, which
the combine sums into their tokens weighted by the gates.

When the expert-parallel group spans several nodes and a token has three or more pairs, the sums
of its pairs (the combine, and the backward of the gather into the input rows) run per node
first, in ascending expert order, then across the nodes in node order (:class:`SumOrder`): the
order in which the hierarchical dispatch (:mod:`moe_dist.moe.dispatch.hierarchical`) must add, so both give
bit-identical results. With one or two pairs per token every order gives the same sum.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ...distributed.collectives import group_rank, group_size
from ...distributed.groups import ParallelGroups
from ...distributed.ranges import A2A, timed_range
from ...distributed.topology import NodeLayout
from ..experts import host_ints
from .counting import count_values
from .dispatcher import Dispatcher
from .exchange import Exchange
from .traffic import COUNTS, TrafficMeter


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


@dataclass
class DispatchPlan:
    token_idx: torch.Tensor  # [N] source token of each sorted kept pair
    gates: torch.Tensor  # [N] gate of each sorted kept pair (gradient)
    local_counts: list  # rows per local expert (received from every rank, this one included)
    exchange: Optional[Exchange] = None  # where the rows travel (expert parallelism), else None
    read_along: Optional[list] = None  # host values of the caller's ``read_along`` tensor
    sum_order: SumOrder = ROW_ORDER  # how a token's pairs are summed (combine, input-row gradient)
    inter_node_pairs: Optional[int] = None  # kept pairs whose expert is on another node (nodes known)
    inter_node_rows: Optional[int] = None  # rows this rank sends to other nodes (flat: one per such pair)


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


def expert_nodes(nodes: NodeLayout, num_experts: int, device) -> torch.Tensor:
    """The node of every expert, and the node count for the index ``num_experts`` (a dropped pair)."""
    local = num_experts // nodes.size
    return host_ints([nodes.node_of[e // local] for e in range(num_experts)] + [nodes.num_nodes], device)


def pair_nodes(kept: torch.Tensor, nodes: NodeLayout, num_experts: int) -> torch.Tensor:
    """The node of each pair's expert (``kept`` ``[T, k]``, ``num_experts`` for a dropped pair, whose
    node is ``nodes.num_nodes``)."""
    return expert_nodes(nodes, num_experts, kept.device)[kept]


def nodes_of_tokens(node: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """``[T, num_nodes]``: whether the token has a kept pair on each node (``node`` ``[T, k]`` from
    :func:`pair_nodes`)."""
    has = torch.zeros((node.shape[0], num_nodes + 1), dtype=torch.bool, device=node.device)
    return has.scatter_(1, node, True)[:, :num_nodes]


def node_sum_order(kept: torch.Tensor, nodes: NodeLayout, num_experts: int, order: torch.Tensor) -> SumOrder:
    """The per-node sum order (module docstring) of the pairs ``order`` picks (flat indices into
    ``kept`` ``[T, k]``, in row order): a token's pairs on one node add up in ascending expert order
    into a partial sum, one slot per node the token reaches (ascending), the slots then in order."""
    node = pair_nodes(kept, nodes, num_experts)
    slot_of_node = torch.cumsum(nodes_of_tokens(node, nodes.num_nodes).long(), 1) - 1
    slot = slot_of_node.gather(1, node.clamp(max=nodes.num_nodes - 1)).reshape(-1).index_select(0, order)
    rows_expert = kept.reshape(-1).index_select(0, order)
    return SumOrder(torch.argsort(rows_expert, stable=True), slot, min(kept.shape[1], nodes.num_nodes))


def inter_node_pairs(send: Sequence[int], nodes: NodeLayout, rank: int) -> int:
    """Rows of a flat send (``send[r]`` to expert-parallel rank ``r``) that leave ``rank``'s node."""
    return sum(n for r, n in enumerate(send) if nodes.node_of[r] != nodes.node_of[rank])


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


def modelled_counts(host_counts: list[list[int]], me: int, local: int, extra: list) -> list[list[int]]:
    """What :func:`read_counts` returns, from the peers' counts known on the host: with one rank
    ``[counts per expert]``, else ``[sent per expert, received per (source, local expert)]``; then the
    ``read_along`` values as zeros (a dry run has no non-finite logits)."""
    along = [[0] * t.numel() for t in extra]
    if len(host_counts) == 1:
        return [list(host_counts[0])] + along
    received = [c for row in host_counts for c in row[me * local:(me + 1) * local]]
    return [list(host_counts[me]), received] + along


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
             meter: Optional[TrafficMeter] = None,
             nodes: Optional[NodeLayout] = None,
             host_counts: Optional[list[list[int]]] = None) -> tuple[torch.Tensor, DispatchPlan]:
    """Gather the kept rows of ``x`` ``[T, d]`` for their experts: grouped by expert, or with
    expert parallelism in send order (``plan.exchange`` says where they travel).

    ``peer_counts``: ``[ep, E]`` kept pairs per expert of every expert-parallel peer (in
    ``ep_group`` rank order) when the caller knows them already; else they are exchanged.
    ``read_along``: small integer tensor the caller wants on the host too; it rides on the
    dispatch's single host read and comes back as ``plan.read_along`` (a list of ints).
    ``meter``: records the bytes of the count exchange and, through ``plan.exchange``, of the rows'
    transfers (:mod:`moe_dist.moe.dispatch.traffic`).
    ``nodes``: the node of every ``ep_group`` rank (None: one node); over several nodes a token's
    three or more pairs sum per node first (module docstring), and the plan counts the rows that
    leave the node.
    ``host_counts``: ``[ep][E]`` kept pairs per expert of every expert-parallel peer, already known
    on the host (a dry run's routing model, :mod:`~moe_dist.moe.stand_in`): then nothing is read and
    ``read_along`` comes back as zeros.

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
        lc, *along = read_counts([counts] + extra) if host_counts is None else modelled_counts(host_counts, 0, 1, extra)
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
        with timed_range(A2A):  # the step-time breakdown counts the wait as the all-to-alls'
            dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=ep_group)  # count exchange first
    else:  # [source peer, my local expert]
        recv_counts = peer_counts.to(device=counts.device, dtype=counts.dtype).view(ep, ep, local)[:, me].contiguous()
    sent, received_counts, *along = (read_counts([send_counts, recv_counts] + extra) if host_counts is None
                                     else modelled_counts(host_counts, me, local, extra))
    send = [sum(sent[r * local:(r + 1) * local]) for r in range(ep)]
    recv = [received_counts[r * local:(r + 1) * local] for r in range(ep)]
    order = order[:sum(send)]
    token_idx = torch.div(order, top_k, rounding_mode="floor")
    plan = DispatchPlan(token_idx, flat_g.index_select(0, order), [sum(row[e] for row in recv) for e in range(local)],
                        Exchange(ep_group, me, send, recv, meter), read_along=along[0] if along else None)
    if nodes is not None and nodes.multi_node:
        plan.inter_node_pairs = plan.inter_node_rows = inter_node_pairs(send, nodes, me)
        if top_k >= 3:
            plan.sum_order = node_sum_order(kept.view(-1, top_k), nodes, num_experts, order)
    return gather_rows(x, token_idx, plan.sum_order), plan


def combine(y: torch.Tensor, plan: DispatchPlan, num_tokens: int) -> torch.Tensor:
    """Sum the expert outputs ``y`` (in the dispatch's row order) into their tokens, weighted by
    the gates. The gate multiply happens in the experts' dtype (no fp32 ``[k, T, d]``
    temporaries). Dropped pairs contribute nothing."""
    return scatter_rows(y, plan.gates.to(y.dtype), plan.token_idx, num_tokens, plan.sum_order)


class FlatDispatcher(Dispatcher):
    """:func:`dispatch`, the experts, :func:`combine` over the expert-parallel group of ``groups``
    (one process before groups are set); ``meter`` records the bytes the exchanges send."""

    name = "flat"

    def __init__(self, num_experts: int, groups: ParallelGroups, meter: Optional[TrafficMeter] = None):
        self.num_experts, self.groups, self.meter = num_experts, groups, meter

    def dispatch(self, rows, routing, keep, read_along, peer_counts=None, host_counts=None):
        return dispatch(rows, routing.expert_ids, routing.gates, keep, self.num_experts, self.groups.ep, peer_counts,
                        read_along, meter=self.meter, nodes=self.groups.ep_nodes, host_counts=host_counts)

    def experts(self, experts, routed, plan):
        return experts(routed, plan.local_counts, plan.exchange)

    def combine(self, y, plan, num_tokens):
        return combine(y, plan, num_tokens)
