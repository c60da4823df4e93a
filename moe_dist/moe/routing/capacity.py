"""Expert capacity and the choice of which token-expert pairs are dropped.

Two scopes:
- ``local``: each source rank applies the capacity to its own tokens (DeepSpeed, Megatron).
- ``global``: the dropped set is exactly the one a single process would drop on the
  concatenated batch (rank-major token order), so drops do not depend on the number of
  ranks. ``position`` needs only the per-rank per-expert counts (which the layer already
  gathers for the router statistics); ``probs`` gathers the gates of all pairs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from ...distributed.collectives import all_gather_tensor, group_rank, group_size
from ..counting import count_values
from ...errors import ConfigError



def expert_capacity(capacity_factor: float, tokens, top_k: int, num_experts: int, min_capacity: int = 0):
    """``max(min_capacity, ceil(capacity_factor * tokens * k / E))`` token slots per expert.

    ``tokens`` an int: an int. ``tokens`` a tensor of token counts (e.g. the globally reduced
    count, still on the device): an int64 tensor of the same shape, computed on the device with
    the same float64 arithmetic in the same order, so it equals the host value exactly and
    needs no host read."""
    if not capacity_factor > 0:
        raise ConfigError(f"model.moe.capacity_factor must be > 0 (or null for dropless), got {capacity_factor}")
    if torch.is_tensor(tokens):
        slots = torch.ceil(tokens.double() * capacity_factor * top_k / num_experts)
        return slots.clamp_min(int(min_capacity)).long()
    return max(int(min_capacity), math.ceil(capacity_factor * tokens * top_k / num_experts))


def _rank_within_expert(expert_flat: torch.Tensor, order: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Given pairs sorted by ``order`` (grouped by expert), each sorted pair's index within its expert."""
    sorted_e = expert_flat[order]
    counts = count_values(sorted_e, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    return torch.arange(order.numel(), device=order.device) - starts[sorted_e]


def _scatter_back(order: torch.Tensor, keep_sorted: torch.Tensor) -> torch.Tensor:
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


def keep_by_position(expert_ids: torch.Tensor, capacity, num_experts: int,
                     start_positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """First come, first served: expert e keeps the first ``capacity`` pairs in token order.

    ``start_positions[e]``: how many pairs of expert e precede this rank's tokens in the
    global order (zero for local scope). ``capacity``: an int or a 0-d tensor (no host read).
    Returns a ``[T, k]`` bool keep mask.
    """
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # token-major flattening => token order per expert
    pos = _rank_within_expert(flat, order, num_experts)
    if start_positions is not None:
        pos = pos + start_positions.to(pos.device)[flat[order]]
    return _scatter_back(order, pos < capacity).view_as(expert_ids)


def _keep_by_gate_ranking(flat_e: torch.Tensor, flat_g: torch.Tensor, capacity, num_experts: int) -> torch.Tensor:
    # order by expert, then gate descending, then original index (stable sorts applied last-key-first)
    by_gate = torch.argsort(-flat_g, stable=True)
    order = by_gate[torch.argsort(flat_e[by_gate], stable=True)]
    pos = _rank_within_expert(flat_e, order, num_experts)
    return _scatter_back(order, pos < capacity)


def keep_by_probs(expert_ids: torch.Tensor, gates: torch.Tensor, capacity, num_experts: int,
                  group: Optional[dist.ProcessGroup] = None, modelled: bool = False) -> torch.Tensor:
    """Expert e keeps its ``capacity`` pairs of highest gate (ties: earlier token first).

    With a ``group`` the ranking is over the pairs of every rank in it (global scope); the
    ranks' pair counts are then read to the host once, to size the gather of every rank's
    gates (one host synchronisation; none without a group, nor when ``modelled``: a dry run,
    where every rank routes as many pairs).
    """
    flat_e = expert_ids.reshape(-1)
    flat_g = gates.detach().reshape(-1).float()
    if group_size(group) == 1:
        return _keep_by_gate_ranking(flat_e, flat_g, capacity, num_experts).view_as(expert_ids)
    n_local = flat_e.numel()
    if modelled:  # a dry run: every rank routes as many pairs
        sizes = [n_local] * group_size(group)
    else:
        sizes = all_gather_tensor(torch.full((1,), n_local, device=flat_e.device), group).view(-1).tolist()  # the one read
    n_max = max(sizes)
    pad = n_max - n_local
    # expert id as a float is exact for any realistic E (< 2**24)
    packed = torch.stack([torch.nn.functional.pad(flat_g, (0, pad)), torch.nn.functional.pad(flat_e.float(), (0, pad))])
    allp = all_gather_tensor(packed, group)  # [R, 2, n_max]
    every = torch.cat([allp[r, :, :n] for r, n in enumerate(sizes)], dim=1)  # [2, all pairs], rank-major
    keep_all = _keep_by_gate_ranking(every[1].long(), every[0], capacity, num_experts)
    start = sum(sizes[: dist.get_rank(group)])
    return keep_all[start : start + n_local].view_as(expert_ids)


@dataclass
class CapacityDecision:
    """Which pairs the experts take: ``keep`` ``[T, k]`` bool (None: dropless, every pair),
    ``capacity`` token slots per expert (None: dropless; a 0-d int64 tensor on the device for the
    global scope, an int for the local one) and ``dropped`` pairs over the stats group (0-d)."""

    keep: Optional[torch.Tensor]
    capacity: Optional[Union[int, torch.Tensor]]
    dropped: torch.Tensor


def apply_capacity(routing, stats, capacity_factor: Optional[float], *, scope: str = "global",
                   drop_policy: str = "position", min_capacity: int = 0,
                   group: Optional[dist.ProcessGroup] = None, modelled: bool = False) -> CapacityDecision:
    """The capacity stage: which of ``routing``'s pairs are kept, from the gathered statistics
    ``stats`` (:class:`~moe_dist.moe.routing.statistics.GatheredStats` over ``group``, the stats group).

    Host synchronisation: none for ``position`` (the capacity and this rank's start positions are
    computed on the device from the gathered counts); ``probs`` with the global scope on 2+ ranks
    reads the ranks' pair counts once (:func:`keep_by_probs`)."""
    total, per_rank = stats.total, stats.per_rank
    if capacity_factor is None:
        return CapacityDecision(None, None, total.counts.new_zeros(()))
    E, k, n_tok = total.num_experts, routing.top_k, routing.expert_ids.shape[0]
    if scope == "global":
        capacity = expert_capacity(capacity_factor, total.tokens, k, E, min_capacity)
        dropped = (total.counts - capacity).clamp_min(0).sum()
        if drop_policy == "position":
            start = per_rank.counts[:group_rank(group)].sum(0).long().to(routing.expert_ids.device)
            keep = keep_by_position(routing.expert_ids, capacity, E, start)
        else:
            keep = keep_by_probs(routing.expert_ids, routing.gates, capacity, E, group, modelled)
        return CapacityDecision(keep, capacity, dropped)
    capacity = expert_capacity(capacity_factor, n_tok, k, E, min_capacity)
    caps = expert_capacity(capacity_factor, per_rank.tokens, k, E, min_capacity)  # every rank's, on the device
    dropped = (per_rank.counts - caps[:, None]).clamp_min(0).sum()
    keep = (keep_by_position(routing.expert_ids, capacity, E) if drop_policy == "position"
            else keep_by_probs(routing.expert_ids, routing.gates, capacity, E, None))
    return CapacityDecision(keep, capacity, dropped)
