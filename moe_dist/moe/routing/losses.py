"""Load-balance (Switch / GShard) and router z-loss from reduced per-expert statistics.

Convention (used throughout moe_dist): a rank's loss tensor is its *share* of the
global loss, so the shares summed over the ranks that hold distinct tokens give the
loss one process would compute on the whole batch, and gradients are *summed* over
those ranks (``moe_dist.parallel.sync_gradients``). The reported values are the global
ones, identical on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch



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




def sequence_balance_sum(probs: torch.Tensor, expert_ids: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """DeepSeek-V2/V3's sequence-wise balance loss summed over this rank's sequences:
    ``sum_b E * sum_e f_{b,e} P_{b,e}`` with, over the ``S`` tokens of sequence ``b``,
    ``f_{b,e} = count_{b,e} / (S k)`` and ``P_{b,e} = mean_t p_{t,e}`` (gradient through P only).

    probs: ``[B*S, E]``; expert_ids: ``[B*S, k]``, rows sequence-major. A sequence's term
    depends on that sequence alone, so the global loss (the sum over every rank's sequences
    divided by the global number of sequences) does not depend on how sequences are split."""
    tokens, num_experts = probs.shape
    if num_sequences == 0 or tokens == 0:
        return probs.sum() * 0.0
    seq_len, k = tokens // num_sequences, expert_ids.shape[1]
    seq_of_row = torch.arange(tokens, device=probs.device) // seq_len
    flat = (expert_ids + (seq_of_row * num_experts)[:, None]).reshape(-1)
    counts = torch.zeros(num_sequences * num_experts, dtype=probs.dtype, device=probs.device)
    counts = counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=probs.dtype)).view(num_sequences, num_experts)
    f = counts / (seq_len * k)
    p = probs.view(num_sequences, seq_len, num_experts).sum(1) / seq_len
    return num_experts * (f * p).sum()


@dataclass
class BalanceLosses:
    """One forward's auxiliary losses: ``aux_share`` / ``z_share`` this rank's differentiable shares,
    ``aux_value`` / ``z_value`` the reported values (0-d tensors, identical on every rank)."""

    aux_share: torch.Tensor
    z_share: torch.Tensor
    aux_value: torch.Tensor
    z_value: torch.Tensor

    def weighted(self, aux_loss_coef: float, z_loss_coef: float) -> torch.Tensor:
        """The auxiliary loss to add to the task loss (this rank's share)."""
        return aux_loss_coef * self.aux_share + z_loss_coef * self.z_share


def balance_losses(routing, stats, loss_scope: str = "global", balance_loss: str = "batch",
                   seq_loss_sum: Optional[torch.Tensor] = None, num_sequences: int = 0) -> BalanceLosses:
    """The load-balance and z losses of ``routing`` (this rank's :class:`~moe_dist.moe.routing.types.Routing`)
    from the gathered statistics ``stats`` (:class:`~moe_dist.moe.routing.statistics.GatheredStats`;
    ``loss_scope=local`` needs its per-rank values). ``seq_loss_sum``: this rank's
    :func:`sequence_balance_sum` over its ``num_sequences`` sequences for ``balance_loss=sequence``. Token counts stay on the device
    (no host read)."""
    probs, logits, k = routing.probs, routing.logits, routing.top_k
    total, per_rank, local = stats.total, stats.per_rank, stats.local
    if loss_scope == "global":
        tokens_f = total.tokens.to(probs.dtype)
        if balance_loss == "sequence":
            aux_share = seq_loss_sum / total.sequences.clamp_min(1).to(probs.dtype)
            aux_value = total.seq_loss_sum / total.sequences.clamp_min(1)
        else:
            aux_share = load_balance_share(probs, total.counts.float(), tokens_f, k)
            aux_value = load_balance_value(total.counts, total.prob_sums, total.tokens, k)
        z_share = z_loss_share(logits, tokens_f) if logits is not None else probs.new_zeros(())
        z_value = total.z_sum / total.tokens.clamp_min(1)
        return BalanceLosses(aux_share, z_share, aux_value, z_value)
    ranks = stats.ranks
    local_tokens = float(max(routing.expert_ids.shape[0], 1))
    if balance_loss == "sequence":
        aux_share = seq_loss_sum / (max(num_sequences, 1) * ranks)
        aux_value = (per_rank.seq_loss_sum / per_rank.sequences.clamp_min(1)).mean()
    else:
        aux_share = load_balance_share(probs, local.counts.float(), local_tokens, k) / ranks
        aux_value = load_balance_value(per_rank.counts, per_rank.prob_sums, per_rank.tokens, k).mean()
    z_share = (z_loss_share(logits, local_tokens) / ranks) if logits is not None else probs.new_zeros(())
    z_value = (per_rank.z_sum / per_rank.tokens.clamp_min(1)).mean()
    return BalanceLosses(aux_share, z_share, aux_value, z_value)
