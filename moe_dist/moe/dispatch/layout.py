"""Where a forward's kept pairs go, shared by both dispatchers: the node of each pair's expert, the
send order of the expert-parallel exchange, and the per-node order in which a token's pairs are
summed over several nodes (:mod:`moe_dist.moe.dispatch.flat`'s docstring says why).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ...distributed.topology import NodeLayout
from ..rows import SumOrder, host_ints


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


def send_order_key(expert: torch.Tensor, num_experts: int, ep: int, rank: int) -> torch.Tensor:
    """Sort key of each pair's expert (``num_experts`` for a dropped pair, which keeps it) for the
    send order: the experts of the other ranks in rank order, then this rank's own."""
    local = num_experts // ep
    lo, hi = rank * local, (rank + 1) * local
    own = (expert >= lo) & (expert < hi)
    key = torch.where(own, expert + (num_experts - hi), torch.where(expert >= hi, expert - local, expert))
    return torch.where(expert == num_experts, expert, key)
