"""The routing statistics' row (moe_dist/moe/routing/statistics.py): what one all-gather per MoE layer
carries. Group spans ride in it only with node-limited routing; pack and unpack are inverses."""
from __future__ import annotations

import torch

from moe_dist.moe.routing.types import Routing
from moe_dist.moe.routing.statistics import RoutingStats, group_spans

E, T, K = 8, 12, 2


def _routing(seed: int = 0) -> Routing:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g)
    probs = logits.softmax(-1)
    gates, ids = probs.topk(K, dim=-1)
    return Routing(expert_ids=ids, gates=gates, probs=probs, logits=logits)


def _same(a: RoutingStats, b: RoutingStats) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in ((getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__))


def test_without_groups_the_row_has_no_group_spans():
    stats = RoutingStats.measure(_routing(), E)
    assert stats.group_spans is None
    row = stats.pack()
    assert row.shape == (2 * E + 6,) and row.dtype == torch.float64
    back = RoutingStats.unpack(row, E)
    assert back.group_spans is None and _same(back, stats)


def test_with_groups_the_row_carries_them_and_round_trips():
    routing = _routing(1)
    stats = RoutingStats.measure(routing, E, groups=4)
    row = stats.pack()
    assert row.shape == (3 * E + 6,)
    back = RoutingStats.unpack(row, E)
    assert _same(back, stats)
    # entry j: tokens whose k experts lie in j + 1 of the 4 groups of 2 experts
    spans = [len({int(e) // 2 for e in ids}) for ids in routing.expert_ids]
    want = torch.tensor([spans.count(j + 1) for j in range(E)], dtype=torch.float64)
    assert torch.equal(back.group_spans, want) and torch.equal(group_spans(routing.expert_ids, E, 4).double(), want)


def test_rows_of_several_ranks_unpack_field_by_field():
    rows = torch.stack([RoutingStats.measure(_routing(s), E, groups=2).pack() for s in range(3)])
    per_rank = RoutingStats.unpack(rows, E)
    assert per_rank.counts.shape == (3, E) and per_rank.tokens.shape == (3,) and per_rank.group_spans.shape == (3, E)
    total = RoutingStats.unpack(rows.sum(0), E)
    assert torch.equal(total.counts, per_rank.counts.sum(0)) and float(total.tokens) == 3 * T
