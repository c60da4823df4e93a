"""What one MoE layer reports after each forward (:class:`MoEStats`: counts, drops, losses, entropy;
detached tensors, no host sync until read), and the group-span summary of the metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch


@dataclass
class MoEStats:
    """What one forward pass of an MoE layer routed, over the whole stats group.

    expert_counts: ``[E]`` token-expert pairs routed to each expert (before capacity).
    dropped: pairs dropped by capacity; pairs: all pairs; tokens: tokens routed.
    aux_loss / z_loss: global loss values (identical on every rank).
    entropy: mean over tokens of the entropy of the full routing distribution.
    capacity: token slots per expert (None: dropless; a 0-d int64 tensor on the device for the
        global capacity scope, an int for the local one).
    group_spans: with node-limited routing, ``[E]`` tokens whose experts lie in ``j + 1`` distinct
        expert groups (:func:`~moe_dist.moe.routing.statistics.group_spans`); None without it.
    extras: router-specific figures.
    """

    expert_counts: torch.Tensor
    dropped: torch.Tensor
    pairs: torch.Tensor
    tokens: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    entropy: torch.Tensor
    capacity: Optional[Union[int, torch.Tensor]] = None
    group_spans: Optional[torch.Tensor] = None
    extras: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, total, losses, capacity, routing, grouped: bool = False) -> "MoEStats":
        """The stats of one forward from its stages' results: ``total`` the routing statistics summed
        over the stats group (:class:`~moe_dist.moe.routing.statistics.RoutingStats`), ``losses``
        (:class:`~moe_dist.moe.routing.losses.BalanceLosses`), ``capacity``
        (:class:`~moe_dist.moe.routing.capacity.CapacityDecision`) and this rank's ``routing``; ``grouped``:
        the routing was node-limited (``total`` counted the group spans)."""
        return cls(expert_counts=total.counts, dropped=capacity.dropped, pairs=total.tokens * routing.top_k,
                   tokens=total.tokens, aux_loss=losses.aux_value, z_loss=losses.z_value,
                   entropy=total.entropy_sum / total.tokens.clamp_min(1), capacity=capacity.capacity,
                   group_spans=total.group_spans if grouped else None, extras=dict(routing.extras))

    @property
    def dropped_fraction(self) -> torch.Tensor:
        return self.dropped / self.pairs.clamp_min(1)

    def as_dict(self) -> dict[str, Any]:
        """Plain Python numbers (synchronises with the device)."""
        out = {
            "expert_counts": [int(c) for c in self.expert_counts.round().tolist()],
            "dropped_fraction": float(self.dropped_fraction),
            "aux_loss": float(self.aux_loss),
            "z_loss": float(self.z_loss),
            "entropy": float(self.entropy),
            "tokens": int(self.tokens),
        }
        if self.capacity is not None:
            out["capacity"] = int(self.capacity)
        if self.group_spans is not None:
            out.update(spans_summary(self.group_spans.tolist()))
        for k, v in self.extras.items():
            out[k] = v.tolist() if torch.is_tensor(v) and v.numel() > 1 else (float(v) if torch.is_tensor(v) else v)
        return out


def spans_summary(spans: list) -> dict:
    """``groups_per_token_mean`` and ``groups_per_token_max`` from a group-span histogram (host
    numbers; entry ``j``: tokens whose experts lie in ``j + 1`` groups)."""
    tokens = sum(spans)
    return {"groups_per_token_mean": sum((j + 1) * n for j, n in enumerate(spans)) / max(tokens, 1),
            "groups_per_token_max": max((j + 1 for j, n in enumerate(spans) if n > 0), default=0)}
