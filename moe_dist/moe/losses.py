"""Load-balance (Switch / GShard) and router z-loss from reduced per-expert statistics.

Convention (used throughout moe_dist): a rank's loss tensor is its *share* of the
global loss, so the shares summed over the ranks that hold distinct tokens give the
loss one process would compute on the whole batch, and gradients are *summed* over
those ranks (``moe_dist.parallel.sync_gradients``). The reported values are the global
ones, identical on every rank.
"""
from __future__ import annotations

import torch

LOSS_SCOPES = ("global", "local")


def load_balance_share(probs: torch.Tensor, counts: torch.Tensor, tokens: float, top_k: int) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` restricted to this rank's probabilities.

    counts: ``[E]`` routed pairs per expert over the reduction scope (no gradient);
    tokens: tokens in that scope (a float, or a 0-d tensor in ``probs``' dtype that stays on the
    device); probs: this rank's ``[T, E]`` probabilities (gradient).
    """
    num_experts = probs.shape[-1]
    f = counts.to(probs.dtype) / (tokens * top_k)
    return num_experts * torch.dot(f, probs.sum(0)) / tokens


def z_loss_share(logits: torch.Tensor, tokens: float) -> torch.Tensor:
    """Router z-loss ``mean_t logsumexp(logits_t)^2`` restricted to this rank's tokens."""
    return torch.logsumexp(logits, dim=-1).square().sum() / tokens


def load_balance_value(counts: torch.Tensor, prob_sums: torch.Tensor, tokens: torch.Tensor, top_k: int) -> torch.Tensor:
    """The loss value from statistics alone; ``[..., E]`` inputs, ``[...]`` tokens."""
    tokens = tokens.clamp_min(1)
    f = counts / (tokens.unsqueeze(-1) * top_k)
    p = prob_sums / tokens.unsqueeze(-1)
    return counts.shape[-1] * (f * p).sum(-1)
