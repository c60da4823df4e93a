"""Step time of one layout from link bandwidths and a compute rate: an alpha-beta model.

Every collective costs ``alpha + bytes / beta`` on the link class it crosses:

* ``intra``: one GPU's link inside its node (NVLink; loopback for CPU processes), per direction;
* ``inter``: one node's network uplink, per direction, shared by all ``g`` GPUs of the node.

Collectives:

* **all-to-all** (flat): one ``alpha``; the rows to ranks of its own node go over the GPU's
  intra link while the rows to other nodes go over the node's uplink, which carries those of all
  ``g`` GPUs of the node at once (every GPU of a node is in some expert-parallel group and they
  exchange together): ``alpha + max(intra / beta_intra, g * inter / beta_inter)``.
  **hierarchical**: the inter-node stage, then the fan-out inside the node (two ``alpha``).
* **ring all-gather / reduce-scatter** over ``m`` ranks of ``S`` bytes: ``(m - 1) alpha`` and
  ``S (m - 1) / m`` per rank over the slowest link of the ring; a ring that spans nodes enters
  and leaves each node once, and the node's uplink carries the rings of all groups that have a
  member on it. All-reduce = reduce-scatter + all-gather. gloo's reduce-scatter is an
  all-reduce underneath (:func:`moe_dist.plan.memory.reduce_scatter_bytes`): twice the bytes.
* compute: ``flops / rate`` (one rate for every matmul; attention scores included).

Overlap, as the code overlaps:

* the loop expert kernel's :class:`moe_dist.moe.dispatch.exchange.PipelinedLoop` computes the first half
  of the rows that stay on the rank while the dispatch travels and the second half while the
  outputs return, forward and backward alike: per MoE layer and pass
  ``max(A, c_own / 2) + c_remote + max(A, c_own / 2)`` with ``c_own`` the rank's own rows
  (``1 / ep`` of them; hierarchical: ``1 / r`` of the fan-out inside the node, the inter-node
  stage not overlapped). The other kernels (bmm, grouped_mm, auto) exchange first, then compute:
  ``A + c + A``.
* FSDP2's weight all-gathers and gradient reduce-scatters: with ``fsdp_overlap`` (GPUs: FSDP2
  prefetches the next unit's all-gather on its own stream and reduces on another) they hide
  behind compute except the first gather and the last reduction, and whatever exceeds the
  step's compute; without it (CPU processes: no streams, and no explicit prefetch is configured,
  so each unit waits for its gather) they add up in full.
* the uplink is shared by the all-to-alls and FSDP2's collectives only in time, not in bandwidth
  (not modelled: their contention when both run at once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .dispatch_rows import GroupShape, rows_per_token

GBIT = 1e9 / 8  # bytes per second of one Gbit/s


@dataclass(frozen=True)
class Links:
    """Link rates in Gbit/s per direction and the per-message latency ``alpha`` in seconds."""

    intra_gbps: float  # one GPU's link inside its node
    inter_gbps: float  # one node's uplink, shared by its GPUs
    alpha_s: float

    def intra_s(self, nbytes: float) -> float:
        return nbytes / (self.intra_gbps * GBIT)

    def inter_s(self, nbytes: float) -> float:
        return nbytes / (self.inter_gbps * GBIT)


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


def all_to_all_s(s: GroupShape, dispatch: str, max_groups: Optional[int], rows: float, d_model: int,
                 act_bytes: int, links: Links, gpus_per_node: int) -> dict[str, float]:
    """Seconds of one all-to-all of ``rows`` local token rows: ``inter`` (the node-crossing stage),
    ``intra`` (the hierarchical fan-out; flat: 0, its intra rows travel beside the inter ones), ``total``
    and ``hidden``: the stage the loop kernel's pipeline overlaps (flat: all of it; hierarchical: the
    fan-out, while the inter-node stage waits in full)."""
    per = rows_per_token(s, dispatch, max_groups)
    row_bytes = rows * d_model * act_bytes
    intra = links.intra_s(per["intra"] * row_bytes)
    inter = links.inter_s(gpus_per_node * per["inter"] * row_bytes) if s.nodes > 1 else 0.0
    if dispatch == "hierarchical" and s.nodes > 1:
        return {"inter": links.alpha_s + inter, "intra": links.alpha_s + intra,
                "total": 2 * links.alpha_s + inter + intra, "hidden": links.alpha_s + intra}
    t = links.alpha_s + max(intra, inter)
    return {"inter": t, "intra": 0.0, "total": t, "hidden": t}


def exchange_pass_s(a2a: dict[str, float], expert_s: float, own_fraction: float, overlapped: bool) -> float:
    """One MoE layer's exchange and expert compute in one pass (forward or backward): the rows go
    out, the experts compute, the outputs come back."""
    if not overlapped:
        return 2 * a2a["total"] + expert_s
    own = own_fraction * expert_s
    hidden = a2a["hidden"]  # the stage the pipeline overlaps
    exposed = a2a["total"] - hidden  # hierarchical: the inter-node stage waits in full
    return 2 * exposed + 2 * max(hidden, own / 2) + (expert_s - own)


def ring_s(nbytes: float, members: int, spans_nodes: bool, rings_per_node: int, links: Links) -> float:
    """One ring collective (all-gather or reduce-scatter) of ``nbytes`` (the whole, unsharded) over
    ``members`` ranks; ``rings_per_node``: rings of concurrent groups crossing one node's uplink."""
    if members <= 1:
        return 0.0
    per_rank = nbytes * (members - 1) / members
    t = links.intra_s(per_rank)
    if spans_nodes:
        t = max(t, links.inter_s(per_rank * rings_per_node))
    return (members - 1) * links.alpha_s + t


@dataclass(frozen=True)
class StepWork:
    """What one GPU computes and moves per optimizer step (all micro-batches)."""

    expert_flops: float  # forward + backward (+ recompute) of its experts' rows, per micro-batch per MoE layer
    other_flops: float  # everything else of a micro-batch (attention, dense FFN, routers, head)
    tokens: int  # tokens of one micro-batch on this GPU
    moe_layers: int
    grad_accum: int
    d_model: int
    act_bytes: int
    checkpointing: bool
    overlapped_exchange: bool  # the loop kernel's PipelinedLoop
    sync_s: float  # FSDP2 / gradient synchronisation of the whole step, seconds
    sync_first_last_s: float  # the part that no overlap can hide (the first gather, the last reduction)
    sync_bytes: float = 0.0  # bytes one GPU sends for it


def step_time(work: StepWork, s: Optional[GroupShape], dispatch: str, max_groups: Optional[int], links: Links,
              gpus_per_node: int, rate_flops: float, fsdp_overlap: bool) -> dict[str, float]:
    """Predicted seconds of one optimizer step and its parts."""
    fwd_share = 1 / passes(work.checkpointing)  # forward : backward = 1 : 2, plus a recomputed forward
    expert_pass = work.expert_flops / rate_flops  # per micro-batch per MoE layer, all passes
    compute = (work.other_flops + work.moe_layers * work.expert_flops) / rate_flops * work.grad_accum
    exchange = 0.0
    a2a_s = 0.0
    if s is not None and s.ep > 1 and work.moe_layers:
        a2a = all_to_all_s(s, dispatch, max_groups, work.tokens, work.d_model, work.act_bytes, links, gpus_per_node)
        hier = dispatch == "hierarchical" and s.nodes > 1
        own = 1 / (s.ranks_per_node if hier else s.ep)
        shares = [fwd_share, 2 * fwd_share] + ([fwd_share] if work.checkpointing else [])
        per_mb = sum(exchange_pass_s(a2a, expert_pass * share, own, work.overlapped_exchange) for share in shares)
        exchange = per_mb * work.moe_layers * work.grad_accum
        a2a_s = 2 * len(shares) * a2a["total"] * work.moe_layers * work.grad_accum
    else:
        exchange = work.moe_layers * expert_pass * work.grad_accum
    other = compute - work.moe_layers * expert_pass * work.grad_accum
    if fsdp_overlap:
        sync = max(work.sync_first_last_s, work.sync_s - compute)
    else:
        sync = work.sync_s
    total = other + exchange + sync
    return {"step_s": total, "compute_s": compute, "all_to_all_s": a2a_s,
            "exposed_all_to_all_s": max(0.0, exchange - work.moe_layers * expert_pass * work.grad_accum),
            "sync_s": work.sync_s, "exposed_sync_s": sync}


def passes(checkpointing: bool) -> int:
    """Forward-equivalents of compute per step: forward, backward (twice the forward), a recomputed forward."""
    return 4 if checkpointing else 3


def sync_time(links: Links, cluster: Cluster, ep: int, dense_params: int, expert_params_local: int,
              root_params: int, fsdp: bool, gather_bytes: int, gathers_per_step: int, gloo: bool,
              reductions_per_step: int = 1) -> dict[str, float]:
    """Seconds of one step's weight gathers and gradient reductions (ring collectives): FSDP2
    gathers the dense weights over all ranks and sharded experts over their ``edp`` replicas
    ``gathers_per_step`` times and reduce-scatters fp32 gradients ``reductions_per_step`` times
    (once, or after every micro-batch: ``parallel.grad_sync``); replicated weights
    all-reduce their gradients. ``first_last``: the root unit's gather and reduction;
    ``bytes_per_gpu``: what one rank sends (a ring crosses a node's uplink with one rank's share)."""
    world, g = cluster.world, cluster.gpus_per_node
    edp = world // ep
    spans = cluster.nodes > 1
    reduce_factor = (2 if gloo else 1) * reductions_per_step  # gloo reduce-scatters by an all-reduce

    def ring(nbytes: float, members: int, rings: int) -> float:
        return ring_s(nbytes, members, spans, rings, links)

    expert_rings = min(ep, g)
    if fsdp:
        dense_units = [(dense_params * gather_bytes, gathers_per_step), (dense_params * 4, reduce_factor)]
        expert_units = [(expert_params_local * gather_bytes, gathers_per_step), (expert_params_local * 4, reduce_factor)]
        root_units = [(root_params * gather_bytes, 1), (root_params * 4, reduce_factor)]
    else:  # all-reduce of the fp32 gradients: a reduce-scatter and an all-gather
        dense_units, expert_units, root_units = ([(params * 4, 2)] for params in (dense_params, expert_params_local,
                                                                                  root_params))
    dense = sum(times * ring(nbytes, world, 1) for nbytes, times in dense_units)
    experts = sum(times * ring(nbytes, edp, expert_rings) for nbytes, times in expert_units)
    root = sum(times * ring(nbytes, world, 1) for nbytes, times in root_units)
    sent = (sum(times * nbytes for nbytes, times in dense_units) * (world - 1) / world
            + sum(times * nbytes for nbytes, times in expert_units) * (edp - 1) / edp)
    return {"total": dense + experts, "first_last": min(root, dense + experts), "bytes_per_gpu": sent}
