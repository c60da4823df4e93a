"""Token-graph routing ("Improving Routing in Sparse MoE with Graph of Tokens"):
Similarity-aware and Attention-aware routers.

Both take the base router's expert probabilities ``R`` ``[B, S, E]`` and mix them over the
tokens of the same sequence with a row-stochastic token graph before choosing the top-k:
``P = softmax_j(graph logits) @ R``. The mixing step is attention with ``v = R`` and lives
once, in :func:`mix_over_sequence` (blockwise; causal blocks skip the keys after them).

Coupling is within one sequence only, so the routers need no collective beyond the
layer's own (sequences are never split across data-parallel ranks). They read the sequence
structure from the :class:`~moe_dist.moe.routing.types.RouterInputs` the model hands the layer:
``batch_shape``, ``padding_mask`` (padding keys are masked) and ``causal`` (in decoders a token
never mixes with later tokens); the attention-aware router also its ``attention``.

``mixing_set``: ``all`` mixes over every allowed token (the definitions, Def. 2 / 5);
``lower_entropy`` only over the tokens whose base routing is at most as uncertain as the
token's own, ``J_i = {j : H(r_j) <= H(r_i)}`` (the set of the paper's Prop. 1).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...checks import check_bounds, check_choice
from ..counting import count_values
from ..routing.types import AttentionInputs, Routing, RouterInputs, RoutingContext
from .base import gate_normalization
from .graph_mixing import BLOCK, graph_values_per_token, mask_block_, mix_over_sequence, query_blocks, routing_entropy
from .registry import register_router
from .wrapping import WrappingRouter, topk_set_changed

AUX_PROBS = ("mixed", "base")
# dtype of the token graph's q . k products (forward and backward); the softmax and the mixing stay fp32
GRAPH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SIMILARITIES = ("dot", "cosine")
MIXING_SETS = ("all", "lower_entropy")


def sequence_shape(x: torch.Tensor, inputs: RouterInputs, router: str) -> tuple[int, int]:
    if inputs.batch_shape is None:
        raise ValueError(f"router {router!r} mixes tokens within a sequence and needs the sequence structure: "
                         "hand the layer's forward RouterInputs(batch_shape=(B, S))")
    B, S = inputs.batch_shape
    if B * S != x.shape[0]:
        raise ValueError(f"router {router!r}: batch_shape={tuple(inputs.batch_shape)} does not match "
                         f"{x.shape[0]} router inputs")
    return B, S


class TokenGraphRouter(WrappingRouter):
    """Shared tail of both token-graph routers: mixed probabilities -> top-k -> Routing."""

    local_extras = {"topk_changed": "mean"}  # share of tokens whose top-k set the mixing changed
    supports_expert_bias = supports_group_limit = True
    needs_whole_sequences = True
    eager_under_compile = ("its time is the [S, S] token graph's products inside its own autograd functions, "
                           "which dynamo cannot fuse; compiled it ran slower than eager")

    @classmethod
    def graph_values_per_token(cls, seq_len: int) -> float:
        return graph_values_per_token(seq_len)

    def __init__(self, d_model, num_experts, top_k, base, base_options, normalize, aux_probs, detach_graph,
                 graph_dtype, mixing_set):
        super().__init__(d_model, num_experts, top_k, base, base_options)
        check_choice("model.moe.router_options.aux_probs", aux_probs, AUX_PROBS)
        check_choice("model.moe.router_options.graph_dtype", graph_dtype, GRAPH_DTYPES)
        check_choice("model.moe.router_options.mixing_set", mixing_set, MIXING_SETS)
        self.mixing_set = mixing_set
        self.normalize = gate_normalization(top_k, normalize)
        self.aux_probs = aux_probs
        self.detach_graph = bool(detach_graph)
        self.graph_dtype = GRAPH_DTYPES[graph_dtype]
        self.graph_observers: list[Callable[..., None]] = []  # see add_graph_observer

    def add_graph_observer(self, observe: Callable[..., None]) -> Callable[[], None]:
        """Call ``observe`` with every mixing step of this router (the keyword arguments of
        :func:`mix_over_sequence`'s ``observers``); returns the function that removes it."""
        self.graph_observers.append(observe)
        return lambda: self.graph_observers.remove(observe)

    def mixing_entropy(self, base: Routing, B: int, S: int) -> Optional[torch.Tensor]:
        """``[B, S]`` entropies of the base routing that restrict the mixing set, or None (``all``)."""
        return routing_entropy(base.probs).view(B, S) if self.mixing_set == "lower_entropy" else None

    def finish(self, base: Routing, mixed: torch.Tensor, extras: dict) -> Routing:
        expert_ids, gates = self.choose_topk(mixed, mixed, self.top_k, self.normalize)
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
    mixing_set: ``all`` (default, Def. 2) or ``lower_entropy`` (Prop. 1: only tokens whose base
        routing entropy is at most the token's own).
    graph_dtype: ``fp32`` (default) or ``bf16`` for the graph's ``u . u`` products and their
        gradients (bf16 rounds the scores to 8 significant bits, so ``dot`` logits near
        ``|u|^2 ~ d = 512`` are rounded to multiples of 4 before the division by tau; use a tau of
        sqrt(d) or more, or ``cosine``, with it; timings in benchmarks/results/routers.md).
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, base: str = "topk",
                 base_options: Optional[dict] = None, temperature: float = 1.0, similarity: str = "dot",
                 learn_similarity: bool = False, detach_graph: bool = False, normalize: Optional[bool] = None,
                 aux_probs: str = "mixed", graph_dtype: str = "fp32", mixing_set: str = "all"):
        super().__init__(d_model, num_experts, top_k, base, base_options, normalize, aux_probs, detach_graph, graph_dtype,
                         mixing_set)
        check_bounds("model.moe.router_options.temperature", temperature, gt=0)
        check_choice("model.moe.router_options.similarity", similarity, SIMILARITIES)
        self.temperature, self.similarity = float(temperature), similarity
        self.similarity_weight = nn.Parameter(torch.eye(d_model)) if learn_similarity else None

    def route(self, x: torch.Tensor, ctx: RoutingContext, inputs: RouterInputs) -> Routing:
        B, S = sequence_shape(x, inputs, "similarity")
        base = self.base_routing(x, ctx, inputs)
        with torch.autocast(device_type=x.device.type, enabled=False):
            # plain dot products: u in the layer's dtype, cast once to graph_dtype by the mixing step
            plain = self.similarity == "dot" and self.similarity_weight is None
            u = x.view(B, S, -1) if plain else x.float().view(B, S, -1)
            if self.detach_graph:
                u = u.detach()
            if self.similarity == "cosine":
                u = F.normalize(u, dim=-1)
            q = u if self.similarity_weight is None else u @ self.similarity_weight.float()
            if self.detach_graph:
                q = q.detach()
            keys = None if self.similarity_weight is None else u  # None: the keys are the queries (cast once)
            mixed = mix_over_sequence(base.probs.view(B, S, -1), q, keys, scale=1.0 / self.temperature,
                                      padding_mask=inputs.padding_mask, causal=inputs.causal, mm_dtype=self.graph_dtype,
                                      entropy=self.mixing_entropy(base, B, S), observers=self.graph_observers)
        return self.finish(base, mixed.reshape(B * S, -1), {})


@torch.no_grad()
def lowest_entropy_head(attn_probs: torch.Tensor, padding_mask: Optional[torch.Tensor], causal: bool,
                        block: int = BLOCK) -> torch.Tensor:
    """``[B]`` index of the head whose attention rows have the lowest mean entropy in each
    sequence (mean over real query tokens; ties -> lowest index). No gradient. With ``causal``
    the (zero) entries after the diagonal are skipped."""
    B, H, S, _ = attn_probs.shape
    tiny = torch.finfo(torch.float32).tiny  # (a normal number: denormal logs are slow)
    ent = attn_probs.new_zeros(B, H, S, dtype=torch.float32)
    for i0, i1, e in query_blocks(S, causal, block):
        a = attn_probs[:, :, i0:i1, :e].float()
        ent[:, :, i0:i1] = -a.clamp_min(tiny).log_().mul_(a).sum(-1)  # -sum a log a (0 log 0 = 0)
    if padding_mask is None:
        mean = ent.mean(-1)
    else:
        w = padding_mask.to(ent.device, torch.float32)[:, None, :]
        mean = (ent * w).sum(-1) / w.sum(-1).clamp_min(1)
    return mean.argmin(-1)


# Score elements per block of the entropy scan (fp32): 128 query rows of 8 heads over 512 keys;
# more heads or keys get fewer rows (at least 16), so a block stays a few MiB.
ENTROPY_BLOCK_ELEMENTS = 1 << 19
# the scan's name in profiles (python -m benchmarks.router --parts)
ENTROPY_SCAN_RANGE = "moe_dist.entropy_scan"
# fill for the keys a query may not use in the scan: softmax gives them exactly 0 and 0 * fill = 0
# (an infinite fill would make p * s NaN)
_SCAN_MASKED = torch.finfo(torch.float32).min


@torch.no_grad()
def lowest_entropy_head_from_scores(queries: torch.Tensor, keys: torch.Tensor, padding_mask: Optional[torch.Tensor],
                                    causal: bool, block: Optional[int] = None,
                                    mm_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`lowest_entropy_head` for attention that was never materialised: the rows of
    ``softmax(q k^T / sqrt(d_head))`` (same masks as the model's attention) are formed one
    sequence and one query block at a time (``block`` rows; default: as many as fit
    :data:`ENTROPY_BLOCK_ELEMENTS`) and reduced to their entropy. With ``p`` the row's softmax
    (one fused kernel), ``m`` its largest score and ``p_max`` its largest weight,
    ``log Z = m - log p_max`` and the entropy is ``log Z - sum_j p_j s_j``: one exponential per
    score and no logarithm but one per row (``p_max >= 1 / keys``, so its log is well
    conditioned). queries ``[B, H, S, dh]``, keys ``[B, H_kv, S, dh]`` (GQA: ``H_kv`` divides
    ``H``); the score products in ``mm_dtype``, the rest fp32."""
    with torch.profiler.record_function(ENTROPY_SCAN_RANGE):  # a named range for profilers (benchmarks.router --parts)
        return _lowest_entropy_head_from_scores(queries, keys, padding_mask, causal, block, mm_dtype)


def _lowest_entropy_head_from_scores(queries, keys, padding_mask, causal, block, mm_dtype):
    B, H, S, dh = queries.shape
    groups = H // keys.shape[1]
    if block is None:
        block = max(16, min(BLOCK, ENTROPY_BLOCK_ELEMENTS // (H * S)))
    km = None if padding_mask is None else padding_mask.to(device=queries.device, dtype=torch.bool)
    ent = queries.new_zeros(B, H, S, dtype=torch.float32)
    for b in range(B):
        q = (queries[b:b + 1].float() * (1.0 / math.sqrt(dh))).to(mm_dtype)
        k = keys[b:b + 1].to(mm_dtype)
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
        mask = None if km is None else km[b:b + 1]
        for i0, i1, e in query_blocks(S, causal, block):
            s = torch.matmul(q[:, :, i0:i1], k[:, :, :e].transpose(-1, -2)).float()
            mask_block_(s, i0, causal, mask, _SCAN_MASKED)
            p = torch.softmax(s, -1)
            ent[b:b + 1, :, i0:i1] = s.amax(-1).sub_(p.amax(-1).log_()).sub_(p.mul_(s).sum(-1))
    if km is None:
        mean = ent.mean(-1)
    else:
        w = km.to(torch.float32)[:, None, :]
        mean = (ent * w).sum(-1) / w.sum(-1).clamp_min(1)
    return mean.argmin(-1)


class _HeadOfEachSequence(torch.autograd.Function):
    """``t[b, head[b]]`` for every sequence ``b`` (``t`` ``[B, H, ...]``). The gradient is a plain
    scatter: each (sequence, head) pair is read once, so nothing accumulates (autograd's advanced
    indexing takes its slow accumulating path for this)."""

    @staticmethod
    def forward(ctx, t, head):
        ctx.shape, ctx.dtype = t.shape, t.dtype
        ctx.save_for_backward(head)
        return t[torch.arange(t.shape[0], device=t.device), head]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        head, = ctx.saved_tensors
        d = grad.new_zeros(ctx.shape, dtype=ctx.dtype)
        d[torch.arange(grad.shape[0], device=grad.device), head] = grad
        return d, None


def head_of_each_sequence(t: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """``[B, ...]``: sequence b's slice ``t[b, head[b]]`` of ``t`` ``[B, H, ...]``."""
    return _HeadOfEachSequence.apply(t, head)


@register_router("attention")
class AttentionRouter(TokenGraphRouter):
    """Attention-aware ("A^2") routing: ``P = A^P_{h*} R`` per sequence, then top-k, where h* is
    the head of lowest mean attention entropy and ``A^P_h[i, j] ∝ A_h[i, j] N(u_i | v'_{h,j}, sigma^2 I)``.

    Reads the attention right before this layer (``inputs.attention``, an
    :class:`~moe_dist.moe.routing.types.AttentionInputs`) in one of two forms:

    - scores (what the model hands; ``attention_needs = "scores"``): ``queries`` / ``keys``.
      Nothing ``[B, H, S, S]`` is kept: the entropies are computed block by block without
      gradient, and since ``log A_h[i, j] = q_i.k_j / sqrt(dh)`` up to a row constant, ``A^P_{h*}``
      is one more blockwise softmax over ``[q/sqrt(dh), W_h^T u / sigma^2] . [k, v] - |v'|^2 / 2 sigma^2``;
    - probabilities: ``probs`` ``[B, H, S, S]`` (used when given).

    For the likelihood, ``values`` / ``out_weight`` / ``output`` (v'_{h,j} = W_O,h v_{h,j};
    u = attention output * output_scale).

    sigma: likelihood std (paper default 1). likelihood: False uses ``A_{h*}`` alone.
    output_scale: factor on the attention output used as u (default 1/H).
    Other options (mixing_set included) as for ``similarity`` (graph_dtype also for the entropy scan's scores and the
    likelihood's ``W_h^T u`` products);
    detach_graph stops gradients into the attention, v' and u.
    """

    attention_needs = "scores"
    local_extras = {**TokenGraphRouter.local_extras, "selected_heads": "sum"}  # sequences per chosen head

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, base: str = "topk",
                 base_options: Optional[dict] = None, sigma: float = 1.0, likelihood: bool = True,
                 output_scale: Optional[float] = None, detach_graph: bool = False,
                 normalize: Optional[bool] = None, aux_probs: str = "mixed", graph_dtype: str = "fp32",
                 mixing_set: str = "all"):
        super().__init__(d_model, num_experts, top_k, base, base_options, normalize, aux_probs, detach_graph, graph_dtype,
                         mixing_set)
        check_bounds("model.moe.router_options.sigma", sigma, gt=0)  # types: the registry (build_router)
        self.sigma, self.likelihood, self.output_scale = float(sigma), bool(likelihood), output_scale

    def _value_path(self, attention: AttentionInputs):
        if not self.likelihood:
            return None
        missing = [key for key in ("values", "out_weight", "output") if getattr(attention, key) is None]
        if missing:
            raise ValueError(f"router 'attention' with likelihood=True needs the attention sub-layer's {missing} "
                             "(AttentionInputs; or set model.moe.router_options.likelihood=false)")
        return attention.values, attention.out_weight, attention.output

    def _likelihood_terms(self, value_path, head: torch.Tensor, H: int, B: int, S: int):
        """``(q_l [B, S, dh], k_l [B, S, dh], key_bias [B, S])`` with ``q_l . k_l + key_bias`` the
        log-likelihood ``log N(u_i | v'_j, sigma^2 I)`` up to a row constant."""
        values, w_out, out = value_path
        Hkv, dh = values.shape[1], values.shape[-1]
        if H % Hkv or w_out.shape[-1] != H * dh or values.shape[0] != B or values.shape[2] != S:
            raise ValueError(f"router 'attention': values {tuple(values.shape)} / out_weight "
                             f"{tuple(w_out.shape)} do not fit {H} heads and batch_shape ({B}, {S})")
        # u_i . v'_j = (W_h^T u_i) . v_j with W_h the head's [D, dh] slice of W_O: the dot
        # products run in d_head dimensions, not d_model
        k = head_of_each_sequence(values, head // (H // Hkv)).float()  # v_{h*, j}: [B, S, dh]
        # W_{h*}: [B, D, dh] (index_select: its gradient sums the sequences that chose one head)
        w = w_out.float().view(w_out.shape[0], H, dh).index_select(1, head).permute(1, 0, 2)
        scale = (1.0 / H) if self.output_scale is None else float(self.output_scale)
        # W_h^T u_i, which the mixing step multiplies in graph_dtype: in graph_dtype as well
        mm = self.graph_dtype
        q = torch.bmm(out.view(B, S, -1).to(mm), w.to(mm)).float() * (scale / self.sigma ** 2)
        # log N(u_i | v'_j, sigma^2) = u_i.v'_j / sigma^2 - |v'_j|^2 / 2 sigma^2 + (row constant, cancels)
        v_sq = (torch.bmm(k, w.transpose(1, 2) @ w) * k).sum(-1)  # |W_h v_j|^2 via the [dh, dh] Gram
        return q, k, v_sq / (-2 * self.sigma ** 2)

    def _mix_from_probs(self, inputs: RouterInputs, base: Routing, B: int, S: int):
        A = inputs.attention.probs
        if A.dim() != 4 or A.shape[0] != B or A.shape[2:] != (S, S):
            raise ValueError(f"router 'attention': the attention probs must be [B={B}, H, S={S}, S={S}], got {tuple(A.shape)}")
        H = A.shape[1]
        value_path = self._value_path(inputs.attention)
        head = lowest_entropy_head(A, inputs.padding_mask, inputs.causal)
        a = head_of_each_sequence(A, head).float()  # [B, S, S]
        q = k = key_bias = None
        if value_path is not None:
            q, k, key_bias = self._likelihood_terms(value_path, head, H, B, S)
        if self.detach_graph:
            a, q, k, key_bias = (None if t is None else t.detach() for t in (a, q, k, key_bias))
        mixed = mix_over_sequence(base.probs.view(B, S, -1), q, k, prior=a, key_bias=key_bias,
                                  padding_mask=inputs.padding_mask, causal=inputs.causal, mm_dtype=self.graph_dtype,
                                  entropy=self.mixing_entropy(base, B, S), observers=self.graph_observers)
        return mixed, head, H

    def _mix_from_scores(self, inputs: RouterInputs, base: Routing, B: int, S: int):
        queries, keys = inputs.attention.queries, inputs.attention.keys
        if (queries.dim() != 4 or keys.dim() != 4 or queries.shape[0] != B or queries.shape[2] != S
                or keys.shape[0] != B or keys.shape[2:] != queries.shape[2:] or queries.shape[1] % keys.shape[1]):
            raise ValueError(f"router 'attention': queries {tuple(queries.shape)} / keys {tuple(keys.shape)} "
                             f"do not fit batch_shape ({B}, {S}) (queries [B, H, S, dh], keys [B, H_kv, S, dh])")
        H, dh = queries.shape[1], queries.shape[-1]
        value_path = self._value_path(inputs.attention)
        head = lowest_entropy_head_from_scores(queries, keys, inputs.padding_mask, inputs.causal, mm_dtype=self.graph_dtype)
        q = head_of_each_sequence(queries, head).float() * (1.0 / math.sqrt(dh))  # q_{h*}: [B, S, dh]
        k = head_of_each_sequence(keys, head // (H // keys.shape[1])).float()
        key_bias = None
        if value_path is not None:
            q_l, k_l, key_bias = self._likelihood_terms(value_path, head, H, B, S)
            q, k = torch.cat([q, q_l], -1), torch.cat([k, k_l], -1)
        if self.detach_graph:
            q, k, key_bias = (None if t is None else t.detach() for t in (q, k, key_bias))
        mixed = mix_over_sequence(base.probs.view(B, S, -1), q, k, key_bias=key_bias,
                                  padding_mask=inputs.padding_mask, causal=inputs.causal, mm_dtype=self.graph_dtype,
                                  entropy=self.mixing_entropy(base, B, S), observers=self.graph_observers)
        return mixed, head, H

    def route(self, x: torch.Tensor, ctx: RoutingContext, inputs: RouterInputs) -> Routing:
        B, S = sequence_shape(x, inputs, "attention")
        attention = inputs.attention
        if attention is None or (attention.probs is None and (attention.queries is None or attention.keys is None)):
            raise ValueError("router 'attention' needs the attention sub-layer before its layer: "
                             "RouterInputs(attention=AttentionInputs(...)) with queries [B, H, S, d_head] and keys "
                             "[B, H_kv, S, d_head] (what the model hands for attention_needs='scores') or probs [B, H, S, S]")
        base = self.base_routing(x, ctx, inputs)
        with torch.autocast(device_type=x.device.type, enabled=False):
            if attention.probs is not None:
                mixed, head, H = self._mix_from_probs(inputs, base, B, S)
            else:
                mixed, head, H = self._mix_from_scores(inputs, base, B, S)
        extras = {"selected_heads": count_values(head.detach(), H)}
        return self.finish(base, mixed.reshape(B * S, -1), extras)
