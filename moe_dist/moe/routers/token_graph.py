"""Token-graph routing ("Improving Routing in Sparse MoE with Graph of Tokens"):
Similarity-aware and Attention-aware routers.

Both take the base router's expert probabilities ``R`` ``[B, S, E]`` and mix them over the
tokens of the same sequence with a row-stochastic token graph before choosing the top-k:
``P = softmax_j(graph logits) @ R``. The mixing step is attention with ``v = R`` and lives
once, in :func:`mix_over_sequence` (SDPA: fused kernels where the backend has them).

Coupling is within one sequence only, so the routers need no collective beyond the
layer's own (sequences are never split across data-parallel ranks). In decoders
(``ctx.causal``) a token never mixes with later tokens; padding keys are masked.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..routing import Routing, RoutingContext
from .base import default_normalize, select_topk
from .registry import register_router
from .wrapping import WrappingRouter, topk_set_changed

# What the model hands an attention-aware layer besides ``ctx.attn_probs`` [B, H, S, S]
# (the Gaussian likelihood term needs the attention sub-layer's value path):
ATTN_VALUES = "attn_values"  # ctx.extras: [B, H_kv, S, d_head] value vectors (GQA: H_kv divides H)
ATTN_OUT_WEIGHT = "attn_out_weight"  # ctx.extras: [D, H * d_head] output projection weight
ATTN_OUTPUT = "attn_output"  # ctx.extras: [B, S, D] attention sub-layer output (before the residual)

AUX_PROBS = ("mixed", "base")
SIMILARITIES = ("dot", "cosine")


def sequence_shape(x: torch.Tensor, ctx: RoutingContext, router: str) -> tuple[int, int]:
    if ctx.batch_shape is None:
        raise ValueError(f"router {router!r} mixes tokens within a sequence and needs the sequence structure: "
                         "set the layer's context.batch_shape = (B, S)")
    B, S = ctx.batch_shape
    if B * S != x.shape[0]:
        raise ValueError(f"router {router!r}: context.batch_shape={tuple(ctx.batch_shape)} does not match "
                         f"{x.shape[0]} router inputs")
    return B, S


def key_mask(B: int, S: int, padding_mask: Optional[torch.Tensor], causal: bool, device) -> Optional[torch.Tensor]:
    """``[B or 1, S, S]`` bool, True where query i may mix with key j, or None for 'causal only' /
    'everything'. Padding keys are masked; the diagonal stays allowed so no row is empty."""
    if padding_mask is None:
        return None
    eye = torch.eye(S, dtype=torch.bool, device=device)
    allowed = padding_mask.to(device=device, dtype=torch.bool)[:, None, :] | eye
    if causal:
        allowed = allowed & torch.ones(S, S, dtype=torch.bool, device=device).tril()
    return allowed


def mix_over_sequence(probs: torch.Tensor, q: Optional[torch.Tensor], k: Optional[torch.Tensor], scale: float,
                      bias: Optional[torch.Tensor], allowed: Optional[torch.Tensor], causal: bool) -> torch.Tensor:
    """``P = softmax_j(scale * q_i . k_j + bias_ij) @ probs`` over each sequence, masked.

    probs ``[B, S, E]``; q, k ``[B, S, D]`` (None: no dot-product term); bias ``[B, S, S]`` or
    ``[B, 1, S]`` (``-inf`` allowed) or None; ``allowed`` from :func:`key_mask` (None: all keys,
    or the causal prefix when ``causal``). fp32 throughout.
    """
    B, S, _ = probs.shape
    device = probs.device
    mask = None
    if allowed is not None or bias is not None:
        if allowed is None and causal:
            allowed = torch.ones(S, S, dtype=torch.bool, device=device).tril()[None]
        neg = torch.tensor(float("-inf"), device=device)
        if bias is None:
            mask = allowed
        else:
            mask = bias.expand(B, S, S)
            if allowed is not None:
                mask = torch.where(allowed, mask, neg)
            # a row with no finite entry (e.g. a padded query whose attention row is all zero)
            # falls back to the token itself instead of producing NaN
            empty = ~torch.isfinite(mask).any(-1, keepdim=True)
            eye = torch.eye(S, dtype=torch.bool, device=device)
            mask = torch.where(empty & eye, torch.zeros((), device=device), mask)
    with torch.autocast(device_type=device.type, enabled=False):
        if q is None:  # graph given by the bias alone
            return torch.softmax(mask, dim=-1) @ probs
        out = F.scaled_dot_product_attention(
            q.unsqueeze(1), k.unsqueeze(1), probs.unsqueeze(1),
            attn_mask=None if mask is None else mask.unsqueeze(1),
            is_causal=causal and mask is None, scale=scale)
    return out.squeeze(1)


class TokenGraphRouter(WrappingRouter):
    """Shared tail of both token-graph routers: mixed probabilities -> top-k -> Routing."""

    def __init__(self, d_model, num_experts, top_k, base, base_options, normalize, aux_probs, detach_graph, name):
        super().__init__(d_model, num_experts, top_k, base, base_options, name)
        if aux_probs not in AUX_PROBS:
            raise ValueError(f"model.moe.router_options.aux_probs={aux_probs!r} is not allowed; allowed: {list(AUX_PROBS)}")
        self.normalize = default_normalize(top_k, normalize)
        self.aux_probs = aux_probs
        self.detach_graph = bool(detach_graph)

    def finish(self, base: Routing, mixed: torch.Tensor, extras: dict) -> Routing:
        expert_ids, gates = select_topk(mixed, mixed, self.top_k, self.normalize)
        with torch.no_grad():
            extras = {**base.extras, **extras, "topk_changed": topk_set_changed(expert_ids, base.expert_ids).float().mean()}
        return Routing(expert_ids=expert_ids, gates=gates, probs=mixed if self.aux_probs == "mixed" else base.probs,
                       logits=base.logits, extras=extras)


@register_router("similarity")
class SimilarityRouter(TokenGraphRouter):
    """Similarity-aware routing: ``P = softmax_row(U W_s U^T / tau) R`` per sequence, then top-k.

    base / base_options: the router supplying ``R`` (default ``topk``).
    temperature: tau (paper default 1; with ``dot`` and large d the graph is nearly diagonal).
    similarity: ``dot`` (paper) or ``cosine`` (rows of U L2-normalised first).
    learn_similarity: learn ``W_s`` (initialised to the identity) instead of fixing ``W_s = I``.
    detach_graph: no gradient through the similarity matrix (only through R).
    normalize: renormalise the k gates (default: yes for k > 1; top-1 keeps ``P[i, e*]``).
    aux_probs: load-balance loss on the ``mixed`` P (default) or the ``base`` R.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, base: str = "topk",
                 base_options: Optional[dict] = None, temperature: float = 1.0, similarity: str = "dot",
                 learn_similarity: bool = False, detach_graph: bool = False, normalize: Optional[bool] = None,
                 aux_probs: str = "mixed"):
        super().__init__(d_model, num_experts, top_k, base, base_options, normalize, aux_probs, detach_graph, "similarity")
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"model.moe.router_options.temperature must be > 0, got {temperature!r}")
        if similarity not in SIMILARITIES:
            raise ValueError(f"model.moe.router_options.similarity={similarity!r} is not allowed; allowed: {list(SIMILARITIES)}")
        self.temperature, self.similarity = float(temperature), similarity
        self.similarity_weight = nn.Parameter(torch.eye(d_model)) if learn_similarity else None

    def route(self, x: torch.Tensor, ctx: RoutingContext) -> Routing:
        B, S = sequence_shape(x, ctx, "similarity")
        base = self.base_routing(x, ctx)
        with torch.autocast(device_type=x.device.type, enabled=False):
            u = x.float().view(B, S, -1)
            if self.detach_graph:
                u = u.detach()
            if self.similarity == "cosine":
                u = F.normalize(u, dim=-1)
            q = u if self.similarity_weight is None else u @ self.similarity_weight.float()
            if self.detach_graph:
                q = q.detach()
            allowed = key_mask(B, S, ctx.padding_mask, ctx.causal, x.device)
            mixed = mix_over_sequence(base.probs.view(B, S, -1), q, u, 1.0 / self.temperature, None, allowed, ctx.causal)
        return self.finish(base, mixed.reshape(B * S, -1), {})


def lowest_entropy_head(attn_probs: torch.Tensor, padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``[B]`` index of the head whose attention rows have the lowest mean entropy in each
    sequence (mean over real query tokens; ties -> lowest index). No gradient."""
    B, H, S, _ = attn_probs.shape
    with torch.no_grad():
        ent = torch.stack([torch.special.entr(attn_probs[:, h].float().nan_to_num(0.0)).sum(-1) for h in range(H)], 1)
        if padding_mask is None:
            mean = ent.mean(-1)
        else:
            w = padding_mask.to(ent.device, torch.float32)[:, None, :]
            mean = (ent * w).sum(-1) / w.sum(-1).clamp_min(1)
        return mean.argmin(-1)


@register_router("attention")
class AttentionRouter(TokenGraphRouter):
    """Attention-aware ("A^2") routing: ``P = A^P_{h*} R`` per sequence, then top-k, where h* is
    the head of lowest mean attention entropy and ``A^P_h[i, j] ∝ A_h[i, j] N(u_i | v'_{h,j}, sigma^2 I)``.

    Needs ``ctx.attn_probs`` ``[B, H, S, S]`` (the attention right before this layer) and, for the
    likelihood, ``ctx.extras`` entries ``attn_values`` / ``attn_out_weight`` / ``attn_output``
    (v'_{h,j} = W_O,h v_{h,j}; u = attention output * output_scale).

    sigma: likelihood std (paper default 1). likelihood: False uses ``A_{h*}`` alone.
    output_scale: factor on the attention output used as u (default 1/H, the digest's reading).
    Other options as for ``similarity``; detach_graph stops gradients into A, v' and u.
    """

    needs_attention = True

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, base: str = "topk",
                 base_options: Optional[dict] = None, sigma: float = 1.0, likelihood: bool = True,
                 output_scale: Optional[float] = None, detach_graph: bool = False,
                 normalize: Optional[bool] = None, aux_probs: str = "mixed"):
        super().__init__(d_model, num_experts, top_k, base, base_options, normalize, aux_probs, detach_graph, "attention")
        if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"model.moe.router_options.sigma must be > 0, got {sigma!r}")
        if output_scale is not None and not (isinstance(output_scale, (int, float)) and math.isfinite(output_scale)):
            raise ValueError(f"model.moe.router_options.output_scale must be a number or null (1/heads), got {output_scale!r}")
        self.sigma, self.likelihood, self.output_scale = float(sigma), bool(likelihood), output_scale

    def _attention_inputs(self, ctx: RoutingContext, B: int, S: int):
        A = ctx.attn_probs
        if A is None:
            raise ValueError("router 'attention' needs the attention probabilities of the preceding attention "
                             "sub-layer in context.attn_probs [B, H, S, S] (the model supplies them for layers "
                             "whose router has needs_attention=True)")
        if A.dim() != 4 or A.shape[0] != B or A.shape[2:] != (S, S):
            raise ValueError(f"router 'attention': context.attn_probs must be [B={B}, H, S={S}, S={S}], got {tuple(A.shape)}")
        if not self.likelihood:
            return A, None
        missing = [key for key in (ATTN_VALUES, ATTN_OUT_WEIGHT, ATTN_OUTPUT) if ctx.extras.get(key) is None]
        if missing:
            raise ValueError(f"router 'attention' with likelihood=True needs context.extras {missing} from the "
                             "attention sub-layer (or set model.moe.router_options.likelihood=false)")
        return A, (ctx.extras[ATTN_VALUES], ctx.extras[ATTN_OUT_WEIGHT], ctx.extras[ATTN_OUTPUT])

    def route(self, x: torch.Tensor, ctx: RoutingContext) -> Routing:
        B, S = sequence_shape(x, ctx, "attention")
        base = self.base_routing(x, ctx)
        A, value_path = self._attention_inputs(ctx, B, S)
        H = A.shape[1]
        head = lowest_entropy_head(A, ctx.padding_mask)
        rows = torch.arange(B, device=A.device)
        with torch.autocast(device_type=x.device.type, enabled=False):
            a = A[rows, head].float()  # [B, S, S]
            if self.detach_graph:
                a = a.detach()
            log_a = torch.log(a.clamp_min(torch.finfo(torch.float32).tiny)).masked_fill(a <= 0, float("-inf"))
            q = k = None
            if value_path is not None:
                values, w_out, out = value_path
                Hkv, dh = values.shape[1], values.shape[-1]
                if H % Hkv or w_out.shape[-1] != H * dh or values.shape[0] != B or values.shape[2] != S:
                    raise ValueError(f"router 'attention': attn_values {tuple(values.shape)} / attn_out_weight "
                                     f"{tuple(w_out.shape)} do not fit {H} heads and batch_shape ({B}, {S})")
                v = values[rows, head // (H // Hkv)].float()  # [B, S, dh]
                w = w_out.float().view(w_out.shape[0], H, dh).permute(1, 2, 0)[head]  # [B, dh, D]
                k = v @ w  # v'_{h*, j}: [B, S, D]
                scale = (1.0 / H) if self.output_scale is None else float(self.output_scale)
                q = out.float().view(B, S, -1) * (scale / self.sigma ** 2)
                if self.detach_graph:
                    q, k = q.detach(), k.detach()
                # -||u_i - v'_j||^2 / 2 sigma^2 up to the row constant ||u_i||^2, which the softmax drops
                log_a = log_a - (k.square().sum(-1) / (2 * self.sigma ** 2))[:, None, :]
            allowed = key_mask(B, S, ctx.padding_mask, ctx.causal, x.device)
            mixed = mix_over_sequence(base.probs.view(B, S, -1), q, k, 1.0, log_a, allowed, ctx.causal)
        extras = {"selected_heads": torch.bincount(head.detach(), minlength=H)}
        return self.finish(base, mixed.reshape(B * S, -1), extras)
