"""Hierarchical (node-aware) dispatch: a token crosses to a remote node once, however many of its
experts live there.

The expert-parallel group spans several nodes of ``L`` ranks each. Every rank has a *proxy* on each
other node: the rank there with the same position among its node's ranks (rail-aligned).

    stage 1  (between nodes)  each rank sends one row per token and remote node that holds at least
                              one of the token's kept pairs, to its proxy there, with the token's
                              expert ids and gates on that node (the gates differentiable);
    stage 2  (inside a node)  each rank, as a proxy, forwards the pairs of the rows it holds (its own
                              tokens' pairs on its node, and the rows received for remote origins)
                              to the ranks of their experts, over an :class:`~moe_dist.moe.dispatch.exchange.Exchange`
                              that moves rows only between ranks of one node; the experts compute;
                              the outputs come back, and the proxy sums each row's pairs, weighted by
                              the gates, into one partial row per (token, node);
    stage 3  (between nodes)  the partial rows go back to their origins, which add them up.

Bit-identity with the flat dispatch (:mod:`moe_dist.moe.dispatch.flat`), on the same inputs and weights:

* The experts see the same spans (the rows of one origin for one expert, in token order): the
  stage-2 exchange lists each origin's rows as its own run (``Exchange.runs``), so the ``loop``
  kernel (overlapped with the exchange, :class:`~moe_dist.moe.dispatch.exchange.PipelinedLoop`) runs the
  same kernel calls as the flat path; the other kernels get the rows permuted into the flat
  layout. Every expert output row and every row gradient is bit-identical.
* A token's pairs add up per node, in ascending expert order, then across nodes in node order;
  the flat path adds in that same order whenever it could differ (three or more pairs,
  :class:`~moe_dist.moe.rows.SumOrder`). Outputs, input gradients, gate gradients (so router
  gradients) are bit-identical.
* The expert weight gradients sum the same span products in another order (as the overlapped
  exchange already does): equal to rounding.

Traffic: between nodes, a flat dispatch sends one row per kept pair whose expert is on another
node; this one sends one row per distinct (token, remote node), plus ``2k`` numbers per row (ids
and gates), and as many partial rows back. The plan counts both (``inter_node_pairs``,
``inter_node_rows``).

Host synchronisation: one read per forward (the gathered per-expert and per-node counts, with the
caller's ``read_along``), as the flat dispatch; none in backward. Collectives: one all-gather of the
counts over the expert-parallel group, the stage-1 and stage-3 all-to-alls over this rank's rail
(``ParallelGroups.ep_rail``: its proxies), stage 2 over its node (``ParallelGroups.ep_node``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ...distributed.collectives import all_gather_tensor, all_to_all_rows, group_rank, group_size
from ...distributed.groups import ParallelGroups
from ...distributed.topology import NodeLayout
from ..counting import count_values
from ..rows import SumOrder, gather_rows, host_ints, inverse_permutation, read_counts, scatter_rows
from .dispatcher import DispatchCall, Dispatcher
from .exchange import Exchange, experts_across
from .layout import inter_node_pairs, nodes_of_tokens, pair_nodes, send_order_key
from .traffic import COMBINE, COMBINE_GRAD, COUNTS, DISPATCH, DISPATCH_GRAD, TrafficMeter


def hierarchical_fallback(groups: ParallelGroups) -> Optional[str]:
    """Why ``parallel.dispatch: hierarchical`` runs the flat dispatch on these groups (None: it does
    not; the hierarchical dispatch runs)."""
    nodes = groups.ep_nodes
    if not nodes.multi_node:
        return (f"parallel.dispatch=hierarchical: the expert-parallel group (ep={groups.ep_size}) is on one node, "
                "nothing crosses nodes; running the flat dispatch")
    if not nodes.node_blocks():
        return (f"parallel.dispatch=hierarchical: the expert-parallel group's nodes {list(nodes.node_of)} are not "
                "blocks of equally many consecutive ranks; running the flat dispatch")
    if groups.ep_node is None or groups.ep_rail is None:
        return ("parallel.dispatch=hierarchical: the groups were built without its node and rail groups "
                "(build_parallel_groups(..., dispatch='hierarchical')); running the flat dispatch")
    return None


def dispatch_note(groups: ParallelGroups) -> str:
    """The start-up log's word on ``parallel.dispatch: hierarchical``: that it runs, or why not
    (empty for the default flat dispatch)."""
    if groups.dispatch != "hierarchical":
        return ""
    why = hierarchical_fallback(groups)
    return f"dispatch=flat ({why})" if why else f"dispatch=hierarchical over {groups.ep_nodes.num_nodes} nodes"


@dataclass
class HierarchicalPlan:
    """Where the rows of one forward travel (:func:`dispatch_hierarchical`), and the counts."""

    rail: Optional[dist.ProcessGroup]  # stages 1 and 3: this rank's proxies (rail rank = node)
    num_tokens: int
    row_token: torch.Tensor  # [rows] the token of each stage-1 row (remote nodes' rows by node, own node's last)
    row_sum: SumOrder  # a token's stage-1 rows summed in node order
    to_proxy: list[int]  # stage-1 rows to each node's proxy (none to this node)
    from_origin: list[int]  # stage-1 rows from each node's origin in this rank's position (none from this node)
    held: int  # rows this rank holds as a proxy (received, then its own node's)
    pair_row: torch.Tensor  # [pairs] the held row of each pair, in stage-2 send order
    pair_gates: torch.Tensor  # [pairs] the gate of each pair (differentiable)
    pair_sum: SumOrder  # a held row's pairs summed in ascending expert order
    exchange: Exchange  # stage 2 (inside the node), one run per origin and expert
    local_counts: list[int]  # rows per local expert
    flat_segments: list[tuple[int, int]]  # the flat dispatch's layout of this rank's expert rows
    to_flat: torch.Tensor  # received stage-2 rows -> the flat layout (for the kernels other than loop)
    from_flat: torch.Tensor
    read_along: Optional[list] = None
    rail_meter: Optional["SubgroupMeter"] = None  # records the stage-1 and stage-3 bytes
    inter_node_pairs: int = 0  # rows a flat dispatch would send to other nodes (one per pair)
    inter_node_rows: int = 0  # rows this dispatch sends to other nodes (one per token and node)


class SubgroupMeter:
    """A :class:`~moe_dist.moe.dispatch.traffic.TrafficMeter` of the expert-parallel group, for transfers over
    a subgroup of it (the node or the rail): splits by subgroup rank, recorded by ep rank."""

    def __init__(self, meter: TrafficMeter, ranks: list[int], ep: int):
        self.meter, self.ranks, self.ep = meter, list(ranks), ep

    def _ep(self, splits: list[int]) -> list[int]:
        out = [0] * self.ep
        for r, n in zip(self.ranks, splits):
            out[r] = n
        return out

    def record(self, kind: str, splits: list[int], rows: torch.Tensor) -> None:
        self.meter.record(kind, self._ep(splits), rows)

    def on_backward(self, t: torch.Tensor, kind: str, splits: list[int]) -> torch.Tensor:
        return self.meter.on_backward(t, kind, self._ep(splits))


def _proxy(nodes: NodeLayout, rank: int, node: int) -> int:
    """The rank on ``node`` in ``rank``'s position (``rank`` itself on its own node)."""
    return nodes.peers_on(node)[nodes.local_index(rank)]


def dispatch_hierarchical(x: torch.Tensor, expert_ids: torch.Tensor, gates: torch.Tensor, keep: Optional[torch.Tensor],
                          num_experts: int, groups: ParallelGroups, read_along: Optional[torch.Tensor] = None,
                          meter: Optional[TrafficMeter] = None) -> tuple[torch.Tensor, HierarchicalPlan]:
    """Stage 1: the rows of ``x`` ``[T, d]`` to the proxies, and the pairs of the rows this rank holds
    laid out in stage-2 send order (returned with the plan). Arguments as
    :func:`~moe_dist.moe.dispatch.flat.dispatch`; ``groups``: the expert-parallel group, its node layout
    and this rank's node and rail groups (:func:`hierarchical_fallback` says None). ``meter``:
    records the bytes of every transfer, by expert-parallel rank (:mod:`moe_dist.moe.dispatch.traffic`)."""
    T, k = expert_ids.shape
    ep_group, nodes = groups.ep, groups.ep_nodes
    R, me, N = group_size(ep_group), group_rank(ep_group), nodes.num_nodes
    local, my_node = num_experts // R, nodes.node_of[me]
    kept = expert_ids.reshape(-1) if keep is None else torch.where(keep.reshape(-1), expert_ids.reshape(-1), num_experts)
    node = pair_nodes(kept.view(T, k), nodes, num_experts)  # [T, k]; dropped: N
    has = nodes_of_tokens(node, N)
    # stage-1 row order: the remote nodes ascending (their proxies' rank order), this node's last
    send_nodes = [n for n in range(N) if n != my_node] + [my_node]
    per_node = torch.cat([count_values(kept, num_experts + 1)[:num_experts], has.sum(0)])
    counts = all_gather_tensor(per_node, ep_group)  # [R, E + N]: every rank's kept pairs per expert, rows per node
    if meter is not None:
        meter.record(COUNTS, [1] * R, per_node.view(1, -1))  # its row of counts to every peer
    candidates = torch.argsort((~has[:, send_nodes]).t().reshape(-1).to(torch.int8), stable=True)
    table, *along = read_counts([counts] + ([] if read_along is None else [read_along]))
    C = [table[r * (num_experts + N):r * (num_experts + N) + num_experts] for r in range(R)]
    D = [table[r * (num_experts + N) + num_experts:(r + 1) * (num_experts + N)] for r in range(R)]
    rows = sum(D[me])
    picked = candidates[:rows]  # (node in send order, token) of each stage-1 row, tokens ascending
    row_token = picked % T
    row_node = host_ints(send_nodes, x.device)[torch.div(picked, T, rounding_mode="floor")]
    row_sum = SumOrder(torch.argsort(row_node, stable=True))
    meta = _row_pairs(node, kept.view(T, k), gates, row_token, row_node)
    # stage 1 over the rail: its rank n is this rank's proxy on node n (origin, coming the other way)
    rail_peer = [_proxy(nodes, me, n) for n in range(N)]
    to_proxy = [D[me][n] if n != my_node else 0 for n in range(N)]
    from_origin = [D[rail_peer[n]][my_node] if n != my_node else 0 for n in range(N)]
    away = sum(to_proxy)
    sent = gather_rows(x, row_token, row_sum)
    rail = None if meter is None else SubgroupMeter(meter, rail_peer, R)
    held_x = torch.cat([_to_proxies(sent[:away], from_origin, to_proxy, groups.ep_rail, rail), sent[away:]])
    held_meta = torch.cat([_to_proxies(meta[:away], from_origin, to_proxy, groups.ep_rail, rail), meta[away:]])
    held = held_x.shape[0]
    origins = [rail_peer[n] for n in range(N) if from_origin[n]] + [me]
    origin_rows = [c for c in from_origin if c] + [rows - away]
    origin = torch.repeat_interleave(host_ints(origins, x.device), host_ints(origin_rows, x.device), output_size=held)
    peers = nodes.peers_on(my_node)  # this node's ranks: the node group's ranks, in order
    served = {p: [_proxy(nodes, p, n) for n in range(N)] for p in peers}  # the origins p is proxy for
    send = [sum(C[o][e] for o in served[me] for e in range(t * local, (t + 1) * local)) for t in peers]
    pair_row, pair_expert, pair_gates = _held_pairs(held_meta, origin, num_experts, R, me, sum(send))
    pair_gates, pair_sum = pair_gates.to(gates.dtype), SumOrder(torch.argsort(pair_expert, stable=True))
    node_meter = None if meter is None else SubgroupMeter(meter, peers, R)
    exchange, flat_segments, to_flat = _stage2(nodes, me, local, C, served, send, groups.ep_node, node_meter, x.device)
    plan = HierarchicalPlan(
        groups.ep_rail, T, row_token, row_sum, to_proxy, from_origin, held, pair_row, pair_gates, pair_sum, exchange,
        [sum(C[o][me * local + e] for o in range(R)) for e in range(local)], flat_segments, to_flat,
        inverse_permutation(to_flat), read_along=along[0] if along else None, rail_meter=rail,
        inter_node_pairs=inter_node_pairs([sum(C[me][r * local:(r + 1) * local]) for r in range(R)], nodes, me),
        inter_node_rows=away)
    return gather_rows(held_x, pair_row, pair_sum), plan


def _to_proxies(rows: torch.Tensor, from_origin: list[int], to_proxy: list[int], rail,
                meter: Optional[SubgroupMeter]) -> torch.Tensor:
    """Stage 1's all-to-all over the rail (differentiable), its bytes recorded both ways."""
    if meter is not None:
        meter.record(DISPATCH, to_proxy, rows)
    received = all_to_all_rows(rows, from_origin, to_proxy, rail)
    return received if meter is None else meter.on_backward(received, DISPATCH_GRAD, from_origin)


def _row_pairs(node: torch.Tensor, kept: torch.Tensor, gates: torch.Tensor, row_token: torch.Tensor,
               row_node: torch.Tensor) -> torch.Tensor:
    """What travels with each stage-1 row: ``[rows, 2k]``, the gates (differentiable; 0 where the
    pair is not on the row's node or dropped) then the expert ids (-1 there), in the gates' dtype or
    fp32 (expert ids are exact in either)."""
    mask = node.index_select(0, row_token) == row_node.unsqueeze(1)
    ids = torch.where(mask, kept.index_select(0, row_token), -1)
    row_gates = torch.where(mask, gates.index_select(0, row_token), torch.zeros((), dtype=gates.dtype, device=gates.device))
    dtype = torch.promote_types(gates.dtype, torch.float32)
    return torch.cat([row_gates.to(dtype), ids.to(dtype)], 1)


def _held_pairs(held_meta: torch.Tensor, origin: torch.Tensor, num_experts: int, ep: int, me: int,
                pairs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs of the held rows in stage-2 send order (this node's other ranks, then this rank; by
    expert, then by origin, each origin's rows in token order): their held row, expert and gate."""
    k = held_meta.shape[1] // 2
    ids = held_meta[:, k:].detach().long().reshape(-1)
    key = torch.where(ids >= 0, send_order_key(ids.clamp(min=0), num_experts, ep, me) * ep + origin.repeat_interleave(k),
                      num_experts * ep)
    order = torch.argsort(key, stable=True)[:pairs]
    return (torch.div(order, k, rounding_mode="floor"), ids.index_select(0, order),
            held_meta[:, :k].reshape(-1).index_select(0, order))


def _stage2(nodes: NodeLayout, me: int, local: int, C: list, served: dict, send: list[int], group,
            meter: Optional[SubgroupMeter], device):
    """The stage-2 exchange over the node group (one run per proxy, expert and origin, in arrival
    order), the flat dispatch's layout of this rank's expert rows (by origin: the others in rank
    order, this rank last; then by expert) and the permutation from the arrival layout to it."""
    peers = nodes.peers_on(nodes.node_of[me])
    mine = peers.index(me)
    start, pos, runs = {}, 0, [[] for _ in peers]
    for i in [i for i in range(len(peers)) if i != mine] + [mine]:  # arrival order: the others, then this rank
        for e in range(local):
            for o in sorted(served[peers[i]]):
                c = C[o][me * local + e]
                runs[i].append((e, c))
                start[(o, e)] = pos
                pos += c
    recv = [[sum(c for ee, c in run if ee == e) for e in range(local)] for run in runs]
    exchange = Exchange(group, mine, send, recv, meter, runs)
    sources = [o for o in range(nodes.size) if o != me] + [me]
    flat_blocks = [(o, e, C[o][me * local + e]) for o in sources for e in range(local)]
    shift, sizes, flat_pos = [], [], 0
    for o, e, c in flat_blocks:
        shift.append(start[(o, e)] - flat_pos)
        sizes.append(c)
        flat_pos += c
    to_flat = (torch.repeat_interleave(host_ints(shift, device), host_ints(sizes, device), output_size=pos)
               + torch.arange(pos, device=device))
    return exchange, [(e, c) for _, e, c in flat_blocks], to_flat


def hierarchical_experts(experts, rows: torch.Tensor, plan: HierarchicalPlan) -> torch.Tensor:
    """Stage 2: the pairs' rows (stage-2 send order) through the node's experts and back. The loop
    kernel overlaps the exchange with the rows that stay here; the others get the rows in the flat
    dispatch's layout."""
    return experts_across(experts, rows, plan.exchange, plan.local_counts,
                          regroup=(plan.to_flat, plan.from_flat, plan.flat_segments))


def combine_hierarchical(y: torch.Tensor, plan: HierarchicalPlan) -> torch.Tensor:
    """Stage 3: each held row's pairs summed (weighted by the gates) into one partial row, the
    partial rows back to their origins, a token's partial rows summed in node order."""
    partial = scatter_rows(y, plan.pair_gates.to(y.dtype), plan.pair_row, plan.held, plan.pair_sum)
    received = sum(plan.from_origin)
    if plan.rail_meter is not None:
        plan.rail_meter.record(COMBINE, plan.from_origin, partial)
    back = all_to_all_rows(partial[:received], plan.to_proxy, plan.from_origin, plan.rail)
    if plan.rail_meter is not None:
        back = plan.rail_meter.on_backward(back, COMBINE_GRAD, plan.to_proxy)
    return scatter_rows(torch.cat([back, partial[received:]]), None, plan.row_token, plan.num_tokens, plan.row_sum)


class HierarchicalDispatcher(Dispatcher):
    """Stages 1 to 3 over ``groups`` (:func:`hierarchical_fallback` says None); ``meter`` records
    the bytes of every transfer."""

    name = "hierarchical"

    def __init__(self, num_experts: int, groups: ParallelGroups, meter: Optional[TrafficMeter] = None):
        self.num_experts, self.groups, self.meter = num_experts, groups, meter

    models_counts = False  # a dry run models the flat dispatch

    def dispatch(self, rows, routing, call: DispatchCall):
        # call.known_counts is not needed: every rank's counts are gathered with the per-node row counts
        return dispatch_hierarchical(rows, routing.expert_ids, routing.gates, call.keep, self.num_experts, self.groups,
                                     call.read_along, meter=self.meter)

    def experts(self, experts, routed, plan):
        return hierarchical_experts(experts, routed, plan)

    def combine(self, y, plan, num_tokens):
        return combine_hierarchical(y, plan)
