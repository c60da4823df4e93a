"""A stand-in for the gate the Adaptive Clustering authors' language-model code puts in the MoE
layers before the clustered ones (``CustomNaiveGate_Balance_SMoE`` in their
``language-modeling/custom_gates.py``), written from reading it: an ``nn.Linear(d_model, E)``
with its default initialisation and a bias, logits ``x W^T + b``, the top-k of the logits and a
softmax over those k values as the gates. Nothing rescales its weight: the in-place rescale to
norm 1.5 of their code touches only the clustered gate's expert embeddings."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class AuthorsPlainGate(nn.Module):
    def __init__(self, d_model: int, num_experts: int, top_k: int):
        super().__init__()
        self.gate = nn.Linear(d_model, num_experts)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits [T, E], expert ids [T, k], gates [T, k])``."""
        logits = self.gate(x)
        values, ids = torch.topk(logits, k=self.top_k, dim=-1, largest=True, sorted=False)
        return logits, ids, F.softmax(values, dim=-1)


def dense_gates(ids: torch.Tensor, gates: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``[T, E]`` with each token's gate at its chosen experts and 0 elsewhere (independent of the
    order the k choices come in)."""
    return torch.zeros(ids.shape[0], num_experts, dtype=gates.dtype).scatter(1, ids, gates)
