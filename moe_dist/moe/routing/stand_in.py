"""Stand-in routing for a dry run: the counts the dispatch would read, from a stated model.

A dry run (``moe-dist plan --dry-run``) runs the layer on fake tensors, which hold shapes but
no values. The only values that decide a shape in the MoE layer are the routed pairs per expert
(the dispatch's one host read: split sizes and rows per local expert) and, for some settings,
the ranks' token counts. Under :func:`moe_dist.moe.layer.set_stand_in` the layer takes them from
a :class:`RoutingModel` instead of reading the device:

- ``balanced``: every expert receives ``T k / E`` of each rank's ``T k`` pairs;
- ``skew:F``: the busiest expert (expert 0) receives ``F`` times the mean, the others share the
  rest evenly (so the memory of dropless layers under imbalance is seen before launch);
- a histogram: the share of each expert per MoE layer, e.g. from a run's ``metrics.jsonl``
  (:func:`histogram_from_metrics`);
- :class:`RecordedRouting`: every rank's exact counts of each layer call, recorded from a real run
  (the dry run's own validation).

Every rank of a model routes the same shares (``balanced``, ``skew``, a histogram); a capacity
factor then caps what each rank keeps, as :func:`~moe_dist.moe.routing.capacity.apply_capacity` would.
"""
from __future__ import annotations

import abc
import json
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from ...errors import ConfigError
from .capacity import expert_capacity


def apportion(total: int, shares: Sequence[float]) -> list[int]:
    """``total`` split into integers proportional to ``shares`` (largest remainder; sums to ``total``)."""
    s = float(sum(shares))
    exact = [total * w / s for w in shares]
    out = [int(math.floor(x)) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in by_remainder[:total - sum(out)]:
        out[i] += 1
    return out


class RoutingModel(abc.ABC):
    """Per-expert shares of the routed pairs, the same on every rank (per MoE layer)."""

    name = "model"

    @abc.abstractmethod
    def shares(self, layer_idx: int, num_experts: int) -> list[float]:
        """The relative load of each expert of MoE layer ``layer_idx``."""

    def routed(self, call: "LayerCall") -> list[list[int]]:
        """``[R][E]`` pairs each rank of the stats group routes to each expert (before capacity)."""
        row = apportion(call.tokens * call.top_k, self.shares(call.layer_idx, call.num_experts))
        return [list(row) for _ in range(call.ranks)]

    def busiest_expert(self, layer_idx: int, num_experts: int) -> int:
        shares = self.shares(layer_idx, num_experts)
        return max(range(num_experts), key=lambda e: (shares[e], -e))

    def describe(self) -> str:
        return self.name


class Balanced(RoutingModel):
    name = "balanced"

    def shares(self, layer_idx: int, num_experts: int) -> list[float]:
        return [1.0] * num_experts


class Skewed(RoutingModel):
    """Expert 0 receives ``factor`` times the mean share; the other experts share the rest evenly."""

    def __init__(self, factor: float):
        self.factor = factor
        self.name = f"skew:{factor:g}"

    def shares(self, layer_idx: int, num_experts: int) -> list[float]:
        top = min(self.factor, num_experts) / num_experts
        rest = (1.0 - top) / (num_experts - 1) if num_experts > 1 else 0.0
        return [top] + [rest] * (num_experts - 1)


class Histogram(RoutingModel):
    """Measured per-expert counts of each MoE layer (``{layer_idx: [E counts]}``); a layer that is
    not listed takes the mean of the listed ones."""

    def __init__(self, per_layer: dict[int, list[float]], source: str = "histogram"):
        if not per_layer:
            raise ConfigError(f"--routing: {source}: no expert counts found")
        self.per_layer = {int(k): [float(c) for c in v] for k, v in per_layer.items()}
        self.name = f"histogram:{source}"

    def shares(self, layer_idx: int, num_experts: int) -> list[float]:
        row = self.per_layer.get(layer_idx)
        if row is None:
            rows = list(self.per_layer.values())
            row = [sum(r[e] for r in rows) / len(rows) for e in range(len(rows[0]))]
        if len(row) != num_experts:
            raise ConfigError(f"--routing: {self.name}: layer {layer_idx} has {len(row)} expert counts, "
                              f"the model has {num_experts} experts")
        if sum(row) <= 0:
            return [1.0] * num_experts
        return row


class RecordedRouting(RoutingModel):
    """Every rank's routed pairs per expert (``[R][E]``) of each layer forward, in call order, as a
    real run measured them (``dry_run(..., fake=False)``'s ``routed_calls`` of every rank): the dry
    run then sees the same shapes."""

    name = "recorded"

    def __init__(self, calls: list[list[list[int]]]):
        self.calls, self.next = [[list(map(int, r)) for r in c] for c in calls], 0

    def routed(self, call: "LayerCall") -> list[list[int]]:
        if self.next >= len(self.calls):
            raise RuntimeError(f"recorded routing: {len(self.calls)} layer calls were recorded, the run makes more")
        rows, self.next = self.calls[self.next], self.next + 1
        if len(rows) != call.ranks or any(sum(r) != call.tokens * call.top_k for r in rows):
            raise RuntimeError("recorded routing: the recorded call does not match this layer call's ranks or tokens")
        return rows

    def shares(self, layer_idx: int, num_experts: int) -> list[float]:
        return [float(sum(r[e] for c in self.calls for r in c)) for e in range(num_experts)]


@dataclass(frozen=True)
class LayerCall:
    """What a layer forward asks of the routing model: its tokens and layout (``ranks`` of the stats
    group, this one ``rank``), and its capacity (``capacity_factor`` None: dropless)."""

    layer_idx: int
    tokens: int
    top_k: int
    num_experts: int
    ranks: int
    rank: int
    capacity_factor: Optional[float] = None
    scope: str = "global"
    drop_policy: str = "position"
    min_capacity: int = 0


def kept_counts(routed: list[list[int]], call: LayerCall) -> list[list[int]]:
    """``[R][E]`` pairs each rank keeps: all (dropless); up to the per-rank capacity (``local``); for
    the ``global`` scope the first ``capacity`` pairs of the concatenated batch in rank order
    (``position``), or an even share of the capacity over the ranks that route to the expert
    (``probs``: gates that do not favour one rank)."""
    if call.capacity_factor is None:
        return routed
    E, k = call.num_experts, call.top_k
    if call.scope == "local":
        cap = expert_capacity(call.capacity_factor, call.tokens, k, E, call.min_capacity)
        return [[min(c, cap) for c in row] for row in routed]
    cap = expert_capacity(call.capacity_factor, call.tokens * call.ranks, k, E, call.min_capacity)
    kept = [[0] * E for _ in routed]
    for e in range(E):
        column = [row[e] for row in routed]
        if call.drop_policy == "position":
            left = cap
            for r, c in enumerate(column):
                kept[r][e] = min(c, max(left, 0))
                left -= c
        else:
            total = sum(column)
            for r, share in enumerate(apportion(min(cap, total), column) if total else column):
                kept[r][e] = min(column[r], share)
    return kept


def parse_routing_model(spec: str) -> RoutingModel:
    """``balanced``, ``skew:F`` (F >= 1), or ``PATH`` of a run's ``metrics.jsonl`` (or its run directory)."""
    text = (spec or "").strip()
    if text == "balanced":
        return Balanced()
    if text.startswith("skew:"):
        try:
            factor = float(text[5:])
        except ValueError:
            factor = float("nan")
        if not factor >= 1:
            raise ConfigError(f"--routing: {spec!r}; allowed: skew:F with F >= 1 (the busiest expert's load over the mean)")
        return Skewed(factor)
    path = os.path.join(text, "metrics.jsonl") if os.path.isdir(text) else text
    if text and os.path.isfile(path):
        return histogram_from_metrics(path)
    raise ConfigError(f"--routing: {spec!r}; allowed: balanced, skew:F (F >= 1), or a run's metrics.jsonl (or run directory)")


def histogram_from_metrics(path: str) -> Histogram:
    """The per-expert counts of each MoE layer in the last row of ``metrics.jsonl`` that has them
    (``row["moe"][<block index>]["expert_counts"]``, as the trainer logs them)."""
    found: dict[int, list[float]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            layers = _expert_counts(row)
            if layers:
                found = layers
    return Histogram(found, source=path)


def _expert_counts(row: dict) -> dict[int, list[float]]:
    out = {}
    moe = row.get("moe")
    if isinstance(moe, dict):
        for key, value in moe.items():
            counts = value.get("expert_counts") if isinstance(value, dict) else None
            idx = "".join(ch for ch in str(key) if ch.isdigit())
            if isinstance(counts, list) and idx:
                out[int(idx)] = counts
    return out
