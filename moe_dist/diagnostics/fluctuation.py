"""Routing fluctuation: how many tokens of a fixed probe set change experts between two
evaluations (top-1 expert, and the set of k chosen experts)."""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from ..moe import moe_layers
from ..moe.routing.types import Routing


def ranked_experts(routing: Routing) -> torch.Tensor:
    """``[T, k]`` chosen experts ordered by gate, largest first (ties keep the router's order),
    so column 0 is the token's top-1 expert."""
    order = torch.sort(routing.gates.detach(), dim=-1, descending=True, stable=True).indices
    return routing.expert_ids.gather(-1, order)


def fluctuation_counts(prev: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    """``[3]`` int64: tokens whose top-1 changed, tokens whose top-k set changed, tokens compared.
    ``prev`` / ``cur``: ``[T, k]`` ranked experts of the same tokens (see :func:`ranked_experts`)."""
    if prev.shape != cur.shape:
        raise ValueError(f"probe assignments differ in shape: {tuple(prev.shape)} vs {tuple(cur.shape)}; "
                         "the probe set must stay fixed between evaluations")
    top1 = (prev[:, 0] != cur[:, 0]).sum()
    topk = (prev.sort(-1).values != cur.sort(-1).values).any(-1).sum()
    return torch.stack([top1, topk, torch.tensor(prev.shape[0], device=prev.device)]).long()


def fluctuation_rates(prev: torch.Tensor, cur: torch.Tensor) -> dict:
    """``{"fluct_top1": share of tokens whose top-1 expert changed, "fluct_topk": share whose
    top-k set changed}``."""
    changed_top1, changed_set, n = fluctuation_counts(prev, cur).tolist()
    return {"fluct_top1": changed_top1 / max(n, 1), "fluct_topk": changed_set / max(n, 1)}


@torch.no_grad()
def probe_assignments(model: nn.Module, tokens: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                      forward: Optional[Callable] = None) -> dict[str, torch.Tensor]:
    """Route the probe tokens in eval mode; ``{layer key: [T_real, k] ranked experts}`` for the
    real (non-padding) tokens. Collective when the model is distributed: every rank calls it.

    forward: ``forward(model, tokens)`` (default ``model(tokens)``, or with ``padding_mask=``).
    The model's training flag is restored afterwards.
    """
    was_training = model.training
    model.eval()
    try:
        if forward is not None:
            forward(model, tokens)
        elif padding_mask is not None:
            model(tokens, padding_mask=padding_mask)
        else:
            model(tokens)
    finally:
        model.train(was_training)
    real = None if padding_mask is None else padding_mask.reshape(-1).bool()
    out = {}
    for key, layer in layer_keys(model).items():
        ranked = ranked_experts(layer.last_routing)
        out[key] = (ranked if real is None else ranked[real.to(ranked.device)]).cpu()
    return out


def layer_keys(model: nn.Module) -> dict:
    """MoE layers keyed by their block index (``context.layer_idx``), or by position when the
    indices are not distinct."""
    layers = moe_layers(model)
    keys = [str(m.context.layer_idx) for m in layers]
    if len(set(keys)) != len(keys):
        keys = [str(i) for i in range(len(layers))]
    return dict(zip(keys, layers))
