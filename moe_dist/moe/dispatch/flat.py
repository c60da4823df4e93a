"""The flat dispatch: sort-based token dispatch and combine, every pair's row straight to its expert.

No one-hot ``[tokens, experts, capacity]`` masks and no capacity padding: kept
token-expert pairs are sorted by expert and gathered once. With expert parallelism they are
sorted into *send order* (the rows for every other rank in rank order, this rank's own last)
and an :class:`~moe_dist.moe.dispatch.exchange.Exchange` says where they travel; the exchange
(:mod:`moe_dist.moe.dispatch.exchange`) takes them to their experts and the outputs back in the same
order, which the combine sums into their tokens weighted by the gates. The row helpers (gather,
scatter, the sum order) are :mod:`moe_dist.moe.rows`.

When the expert-parallel group spans several nodes and a token has three or more pairs, the sums
of its pairs (the combine, and the backward of the gather into the input rows) run per node
first, in ascending expert order, then across the nodes in node order (:class:`~moe_dist.moe.rows.SumOrder`,
:func:`~moe_dist.moe.dispatch.layout.node_sum_order`): the order in which the hierarchical dispatch
(:mod:`moe_dist.moe.dispatch.hierarchical`) must add, so both give bit-identical results. With one or
two pairs per token every order gives the same sum.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ...distributed.collectives import group_rank, group_size
from ...distributed.groups import ParallelGroups
from ...distributed.ranges import A2A, timed_range
from ...distributed.topology import NodeLayout
from ..counting import count_values
from ..rows import ROW_ORDER, SumOrder, gather_rows, read_counts, scatter_rows
from .dispatcher import DispatchCall, Dispatcher
from .exchange import Exchange, experts_across
from .layout import inter_node_pairs, node_sum_order, send_order_key
from .traffic import COUNTS, TrafficMeter


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


def modelled_counts(host_counts: list[list[int]], me: int, local: int, extra: list) -> list[list[int]]:
    """What :func:`read_counts` returns, from the peers' counts known on the host: with one rank
    ``[counts per expert]``, else ``[sent per expert, received per (source, local expert)]``; then the
    ``read_along`` values as zeros (a dry run has no non-finite logits)."""
    along = [[0] * t.numel() for t in extra]
    if len(host_counts) == 1:
        return [list(host_counts[0])] + along
    received = [c for row in host_counts for c in row[me * local:(me + 1) * local]]
    return [list(host_counts[me]), received] + along


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
    on the host (a dry run's routing model, :mod:`~moe_dist.moe.routing.stand_in`): then nothing is read and
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
    if peer_counts is None and host_counts is not None and keep is None:
        recv_counts = None  # a dry run of a dropless layer: known without a count exchange, as in the real run
    elif peer_counts is None:
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

    def dispatch(self, rows, routing, call: DispatchCall):
        known = call.known_counts
        device_known, host_known = (None, known) if isinstance(known, list) else (known, None)
        return dispatch(rows, routing.expert_ids, routing.gates, call.keep, self.num_experts, self.groups.ep,
                        device_known, call.read_along, meter=self.meter, nodes=self.groups.ep_nodes,
                        host_counts=host_known)

    def experts(self, experts, routed, plan):
        if plan.exchange is None:
            return experts(routed, plan.local_counts)
        return experts_across(experts, routed, plan.exchange, plan.local_counts)

    def combine(self, y, plan, num_tokens):
        return combine(y, plan, num_tokens)
