"""Which dimension FSDP2 splits an expert weight on over its replicas (the ``edp`` ranks).

An expert weight is ``[E_local, rows, cols]`` (``w1``/``w3``: ``[E_local, d_model, d_ff]``,
``w2``: ``[E_local, d_ff, d_model]``). Split on the expert dimension (``Shard(0)``), every
replica holds whole experts: even only when ``edp`` divides ``E_local``. Otherwise FSDP2 hands
``ceil(E_local / edp)`` experts to the first replicas and none to the rest, and pads the
all-gather to ``edp * ceil(E_local / edp)`` experts. Split on a dimension inside the experts
(``within``: the first of dims 1 and 2 that ``edp`` divides), every replica holds the same
slice of every local expert. FSDP2 accepts a split on a dimension other than 0 only when it is
even, so when ``edp`` divides neither dim 1 nor dim 2 the weight stays on dim 0 (padded as
above; :func:`padded_experts` says by how much).

``parallel.expert_shard``: ``auto`` (dim 0 when it is even, else ``within``), ``experts``
(always dim 0) or ``within`` (always inside the experts; refused when no dimension divides).
This module is arithmetic only: the trainer and the planner both ask it.
"""
from __future__ import annotations

from typing import Sequence

from ..errors import ConfigError

CHOICES = ("auto", "experts", "within")
KEY = "parallel.expert_shard"


def _within_dim(shape: Sequence[int], edp: int) -> int | None:
    """The first dimension after the expert one that ``edp`` splits evenly, or None."""
    return next((d for d in range(1, len(shape)) if shape[d] % edp == 0), None)


def shard_dim(shape: Sequence[int], edp: int, choice: str = "auto") -> int:
    """The dimension an expert weight of ``shape`` (``[E_local, ...]``) is split on over ``edp``
    replicas under ``parallel.expert_shard=choice``."""
    if choice not in CHOICES:
        raise ConfigError(f"{KEY}: {choice!r}; allowed: {', '.join(CHOICES)}")
    if edp <= 1 or choice == "experts":
        return 0
    if choice == "auto" and shape[0] % edp == 0:
        return 0
    within = _within_dim(shape, edp)
    if within is None and choice == "within":
        raise ConfigError(f"{KEY}: within, but edp={edp} divides no dimension of the expert weights "
                          f"{list(shape[1:])}; allowed: auto, experts")
    return 0 if within is None else within


def padded_experts(local_experts: int, edp: int) -> int:
    """Experts in FSDP2's all-gather of a dim-0 split: ``edp`` chunks of ``ceil(E_local / edp)``."""
    return -(-local_experts // edp) * edp


def busiest_share(shape: Sequence[int], edp: int, choice: str = "auto") -> float:
    """The largest fraction of a weight of ``shape`` any one replica holds (``1/edp`` when even)."""
    if edp <= 1:
        return 1.0
    dim = shard_dim(shape, edp, choice)
    if dim:
        return 1.0 / edp
    return -(-shape[0] // edp) / shape[0]


def gathered_fraction(shape: Sequence[int], edp: int, choice: str = "auto") -> float:
    """The all-gathered (and reduce-scattered) size of a weight of ``shape`` relative to the weight:
    1 when split evenly, more when FSDP2 pads a dim-0 split."""
    if edp <= 1 or shard_dim(shape, edp, choice):
        return 1.0
    return padded_experts(shape[0], edp) / shape[0]


def expert_weight_shapes(local_experts: int, d_model: int, d_ff: int, gated: bool = True) -> list[tuple[int, int, int]]:
    """The shapes of one layer's expert weights on a rank: ``w1`` (``w3`` when gated) and ``w2``."""
    up = (local_experts, d_model, d_ff)
    return [up, up, (local_experts, d_ff, d_model)] if gated else [up, (local_experts, d_ff, d_model)]
