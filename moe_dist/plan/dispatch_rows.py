"""Expected dispatch rows of one GPU, to ranks on its own node and to other nodes, for a balanced router.

Balanced router: each token's ``k`` experts are ``k`` distinct experts drawn uniformly at random
among the ``E`` experts (without replacement). Expert-parallel groups are ``ep`` contiguous
ranks, ``g`` GPUs per node, so a group spans ``n = ep / r`` nodes with ``r = min(ep, g)`` of its
ranks on each; every rank holds ``E / ep`` experts, every node of the group ``E / n``.

Per token and per transfer (one all-to-all of rows ``d_model`` wide):

* ``flat``: one row per (token, expert) pair that lives on another rank:
  ``k (r - 1) / ep`` to ranks of its own node, ``k (ep - r) / ep`` to other nodes.
* ``hierarchical``: one row per distinct (token, remote node) over the inter-node link, then the
  pairs fanned out inside the node by the receiving rank (one row per pair on another rank of that
  node, own-node pairs included): inter ``(n - 1) p`` with ``p = 1 - C(E - E/n, k) / C(E, k)`` (the
  chance that a given node holds at least one of the token's experts: hypergeometric), intra
  ``k (r - 1) / r``.
* node-limited routing with ``M`` groups, a group being the experts of one node of the group
  (``model.moe.router_groups`` = ``n``): the token's experts lie on at most ``M`` nodes. Every
  node is still equally likely to hold any one pair, so the *pairs* per destination, and with
  them the flat dispatch's rows, do not change. Hierarchical: the expected distinct nodes are
  ``min(M, n p)`` (the group rule keeps the ``M`` groups with the best top-``k/M`` scores and
  takes the top ``k`` inside them; with exchangeable scores the kept groups all receive an expert
  when ``k >= M``, and the limit does not bind when ``n p <= M``; where ``M`` does not divide ``k``
  this overstates by up to ~3%), of which the fraction ``(n - 1) / n`` are remote.

The returned dispatch rows count what *this rank sends* in one all-to-all; bytes per step
multiply by the transfers (forward dispatch, forward return, and the two of backward: 4; a
recomputed forward under activation checkpointing adds 2), the MoE layers, the micro-batches,
the tokens of a micro-batch, ``d_model`` and the activation dtype's size. Summed over all ranks
this is the per-step total the runtime's ``a2a_intra_bytes`` / ``a2a_inter_bytes`` count. Not
counted: the gates and expert ids a hierarchical dispatch sends along with a row (``k`` numbers
against ``d_model``), the per-step count exchange, capacity drops (a balanced router drops few).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import comb, lcm
from typing import Optional

from ..config import ConfigError

DISPATCHES = ("flat", "hierarchical")


@dataclass(frozen=True)
class GroupShape:
    """An expert-parallel group on the nodes: ``ranks_per_node`` of its ranks on each of ``nodes`` nodes."""

    ep: int
    ranks_per_node: int
    nodes: int
    num_experts: int
    top_k: int


def group_shape(ep: int, gpus_per_node: int, num_experts: int, top_k: int) -> Optional[GroupShape]:
    """The group's node layout, or None when ``ep`` contiguous ranks do not fill whole nodes or
    sit inside one (``ep`` neither a multiple nor a divisor of ``gpus_per_node``)."""
    r = min(ep, gpus_per_node)
    if ep % r or gpus_per_node % r:
        return None
    return GroupShape(ep=ep, ranks_per_node=r, nodes=ep // r, num_experts=num_experts, top_k=top_k)


def flat_rows_per_token(ep: int, gpus_per_node: int, top_k: int) -> dict[str, float]:
    """The flat dispatch's rows per token in one all-to-all, averaged over the ranks: ``k (p - 1) / ep``
    to ranks of its own node and ``k (ep - p) / ep`` to other nodes, ``p`` being the ranks of its
    group on its node (itself included): ``min(ep, g)`` when groups fill whole nodes or sit inside
    one, else averaged over the ranks of one period of groups and nodes (``lcm(ep, g)`` ranks)."""
    period = lcm(ep, gpus_per_node)
    peers = 0
    for rank in range(period):
        group, node = rank // ep * ep, rank // gpus_per_node * gpus_per_node
        peers += min(group + ep, node + gpus_per_node) - max(group, node)
    p = peers / period
    return {"intra": top_k * (p - 1) / ep, "inter": top_k * (ep - p) / ep}


def node_hit_probability(num_experts: int, nodes: int, k: int) -> float:
    """The chance that one node (of ``nodes``, ``num_experts / nodes`` experts each) holds at least
    one of a token's ``k`` experts drawn without replacement."""
    per_node = num_experts // nodes
    return 1.0 - comb(num_experts - per_node, k) / comb(num_experts, k)


def distinct_nodes(s: GroupShape, max_groups: Optional[int] = None) -> float:
    """Expected distinct nodes of the group among one token's experts (node-limited: at most ``max_groups``)."""
    unlimited = s.nodes * node_hit_probability(s.num_experts, s.nodes, s.top_k)
    return unlimited if max_groups is None else min(float(max_groups), unlimited)


def rows_per_token(s: GroupShape, dispatch: str, max_groups: Optional[int] = None) -> dict[str, float]:
    """Rows one rank sends per token of its own in one all-to-all: ``intra`` (ranks of its node) and
    ``inter`` (other nodes), for ``dispatch`` (flat or hierarchical) under node-limited routing
    with ``max_groups`` groups (None: no limit)."""
    if dispatch not in DISPATCHES:
        raise ConfigError(f"--dispatch: {dispatch!r}; allowed: {', '.join(DISPATCHES)}, all")
    if max_groups is not None and not 1 <= max_groups <= s.nodes:
        raise ValueError(f"max_groups={max_groups} for a group over {s.nodes} node(s)")
    k, r, n = s.top_k, s.ranks_per_node, s.nodes
    if dispatch == "flat" or n == 1:
        return flat_rows_per_token(s.ep, r, k)
    return {"intra": k * (r - 1) / r, "inter": distinct_nodes(s, max_groups) * (n - 1) / n}


def transfers_per_layer(checkpointing: bool) -> int:
    """All-to-alls of one MoE layer per micro-batch: forward dispatch and return, the two of
    backward, and a recomputed forward's two under activation checkpointing."""
    return 6 if checkpointing else 4


def dispatch_bytes(s: GroupShape, dispatch: str, max_groups: Optional[int], tokens: int, d_model: int,
                   act_bytes: int, moe_layers: int, grad_accum: int, checkpointing: bool) -> dict[str, float]:
    """Bytes one GPU sends per optimizer step in the expert all-to-alls: ``intra`` and ``inter``
    (``tokens``: a micro-batch's tokens on one GPU)."""
    rows = rows_per_token(s, dispatch, max_groups)
    per_row = d_model * act_bytes * transfers_per_layer(checkpointing) * moe_layers * grad_accum * tokens
    return {"intra": rows["intra"] * per_row, "inter": rows["inter"] * per_row}
