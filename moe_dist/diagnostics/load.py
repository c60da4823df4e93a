"""Per-expert load figures from routed token-expert pair counts."""
from __future__ import annotations

import math
from typing import Sequence, Union

import torch

Counts = Union[Sequence[float], torch.Tensor]


def load_summary(counts: Counts) -> dict:
    """Balance figures of one layer's per-expert pair counts ``[E]``.

    load: each expert's share of the routed pairs (1/E each when balanced);
    max_load_ratio: the busiest expert's load over the mean load (1 = balanced, E = collapse);
    load_cv: coefficient of variation (population std / mean) of the counts;
    dead_experts: experts that received no pair.
    With no pair routed at all the ratios are 0 and every expert counts as dead.
    """
    c = [float(v) for v in (counts.tolist() if torch.is_tensor(counts) else counts)]
    if not c:
        raise ValueError("load_summary needs the counts of at least one expert")
    E, total = len(c), sum(c)
    dead = sum(1 for v in c if v == 0)
    if total <= 0:
        return {"load": [0.0] * E, "max_load_ratio": 0.0, "load_cv": 0.0, "dead_experts": dead}
    mean = total / E
    std = math.sqrt(sum((v - mean) ** 2 for v in c) / E)
    return {"load": [v / total for v in c], "max_load_ratio": max(c) / mean, "load_cv": std / mean,
            "dead_experts": dead}
