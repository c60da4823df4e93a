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

import functools
import math
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...checks import check_bounds, check_choice
from ..counting import count_values
from ..routing.types import AttentionInputs, Routing, RouterInputs, RoutingContext
from .base import gate_normalization
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


BLOCK = 128  # query rows per block: causal blocks skip the keys after the block (~half the work)


def _blocks(S: int, causal: bool, block: int):
    """(first query, end query, end key) of each query block."""
    return [(i0, min(S, i0 + block), min(S, i0 + block) if causal else S) for i0 in range(0, S, block)]


def graph_values_per_token(S: int, causal: bool = True, block: int = BLOCK) -> float:
    """Mixing weights the graph keeps for backward per token of a length-``S`` sequence (fp32 values)."""
    return sum((i1 - i0) * e for i0, i1, e in _blocks(S, causal, block)) / S


# Scores more than 50 below their row's maximum are raised to -50 before exp: e^-50 ~ 2e-22 is
# nothing next to the maximum's exp(0) = 1 at float32 precision (even summed over 10^5 keys),
# yet far enough above float32's smallest normal (1.2e-38) that the weights after the row
# division, their products with router probabilities and the backward's products stay normal:
# CPUs run subnormal arithmetic on a slow path (a floor at -87 left half of the similarity
# mixing's weights subnormal once divided by the row sum).
EXP_FLOOR = -50.0


def _softmax_(L: torch.Tensor, i0: int, causal: bool, key_mask: Optional[torch.Tensor],
              entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Row softmax, in place, of the masked score block ``L`` (``-inf`` where a key is not allowed,
    :func:`_mask_block_`); those keys get exactly 0. Entries more than 50 below their row's maximum
    get ``e^-50`` (:data:`EXP_FLOOR`): next to the maximum's ``exp(0) = 1`` that is nothing at
    float32 precision, and it keeps every weight and product downstream normal (similarity logits
    in high dimensions span hundreds)."""
    L.sub_(L.amax(-1, keepdim=True)).clamp_min_(EXP_FLOOR).exp_()
    _entropy_mask_(_mask_block_(L, i0, causal, key_mask, 0.0), i0, entropy, 0.0)
    return L.div_(L.sum(-1, keepdim=True))


def _causal_block(b: int, value: float, device: torch.device) -> torch.Tensor:
    """``[b, b]`` fp32 update for the keys after each query of a diagonal block: ``value`` there and
    0 elsewhere, to add; for ``value = 0``, 0 there and 1 elsewhere, to multiply. Cached for the
    blocks of the mixing step and the scan; a whole sequence's (dense_graph_weights) is not kept."""
    return _cached_causal_block(b, value, device) if b <= BLOCK else _new_causal_block(b, value, device)


def _new_causal_block(b: int, value: float, device: torch.device) -> torch.Tensor:
    above = torch.ones(b, b, dtype=torch.bool, device=device).triu(1)
    if value == 0.0:
        return (~above).to(torch.float32)
    return torch.zeros(b, b, device=device).masked_fill_(above, value)


_cached_causal_block = functools.lru_cache(maxsize=32)(_new_causal_block)


def _mask_block_(L: torch.Tensor, i0: int, causal: bool, key_mask: Optional[torch.Tensor], value: float) -> torch.Tensor:
    """Fill, in place, the scores ``L`` ``[B, (H,) b, e]`` of queries ``i0:i0+b`` a query may not
    use: keys after it (causal) and padded keys (``key_mask`` ``[B, S]``, True = real); a token
    always sees itself."""
    b, e = L.shape[-2], L.shape[-1]
    if causal:  # an add or a multiply by a cached [b, b] block: several times faster than masked_fill_
        if value == 0.0:
            L[..., i0:i0 + b].mul_(_causal_block(b, 0.0, L.device))
        else:  # value + a score is value (-inf), or rounds to it (a finite value far beyond the scores)
            L[..., i0:i0 + b].add_(_causal_block(b, value, L.device))
    if key_mask is not None:
        rows = torch.arange(b, device=L.device)
        allowed = key_mask[:, None, :e].expand(key_mask.shape[0], b, e).clone()
        allowed[:, rows, i0 + rows] = True
        L.masked_fill_(~(allowed if L.dim() == 3 else allowed[:, None]), value)
    return L


def _keep_self_where_empty_(L: torch.Tensor, i0: int) -> torch.Tensor:
    """In place: a query row of the score block ``L`` (queries ``i0:i0+b``) with no finite score
    (a prior that is zero everywhere) gets score 0 on the token itself, so it keeps its own routing."""
    rows = torch.arange(L.shape[-2], device=L.device)
    diag = L[:, rows, i0 + rows]
    L[:, rows, i0 + rows] = torch.where(torch.isneginf(L.amax(-1)), torch.zeros_like(diag), diag)
    return L


def _entropy_mask_(L: torch.Tensor, i0: int, entropy: Optional[torch.Tensor], value: float) -> torch.Tensor:
    """In place: ``value`` on the keys of the score block ``L`` (queries ``i0:i0+b``) whose routing
    entropy exceeds the query's (``entropy`` ``[B, S]``, or None: nothing; the token itself always
    stays)."""
    if entropy is not None:
        b, e = L.shape[-2], L.shape[-1]
        L.masked_fill_(entropy[:, None, :e] > entropy[:, i0:i0 + b, None], value)
    return L


def routing_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy of each row of ``probs`` ``[..., E]`` (fp32, no gradient)."""
    with torch.no_grad():
        p = probs.float()
        return -(p * p.clamp_min(torch.finfo(torch.float32).tiny).log()).sum(-1)


class _GraphMix(torch.autograd.Function):
    """Blockwise ``softmax_j(L_ij) @ R`` with ``L = scale * q k^T + log(prior) + key_bias``, masked;
    nothing after the diagonal is computed when causal. Saves the softmax blocks for backward.
    ``k`` None with ``q`` given: the keys are the queries (self-similarity; cast once, one
    gradient). The ``q k^T`` products and their gradients run in ``mm_dtype`` (the scores, the
    softmax and the mixing stay fp32)."""

    @staticmethod
    def forward(ctx, probs, q, k, prior, key_bias, scale, key_mask, causal, block, mm_dtype, entropy):
        B, S, E = probs.shape
        out = probs.new_empty(B, S, E)
        ctx.keys_are_queries = q is not None and k is None
        if q is not None:
            ctx.q_dtype = q.dtype
            ctx.k_dtype = None if k is None else k.dtype
            q = q.to(mm_dtype)
            k = q if k is None else k.to(mm_dtype)
        neg = float("-inf")
        weights = []
        for i0, i1, e in _blocks(S, causal, block):
            L = None
            if q is not None:
                L = torch.bmm(q[:, i0:i1], k[:, :e].transpose(1, 2)).float().mul_(scale)
            if prior is not None:
                log_prior = torch.log(prior[:, i0:i1, :e])  # exact -inf where the prior is 0
                L = log_prior if L is None else L.add_(log_prior)
            if key_bias is not None:
                L.add_(key_bias[:, None, :e])
            _mask_block_(L, i0, causal, key_mask, neg)
            _entropy_mask_(L, i0, entropy, neg)
            if prior is not None:  # only a prior can leave a row without a finite logit
                _keep_self_where_empty_(L, i0)
            W = _softmax_(L, i0, causal, key_mask, entropy)
            out[:, i0:i1] = torch.bmm(W, probs[:, :e])
            weights.append(W)
        ctx.scale, ctx.causal, ctx.block = scale, causal, block
        # q, k in mm_dtype; out for the softmax backward's row terms
        ctx.save_for_backward(probs, q, None if ctx.keys_are_queries else k, prior, out, *weights)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        probs, q, k, prior, out, *weights = ctx.saved_tensors
        need_probs, need_q, need_k, need_prior, need_bias = ctx.needs_input_grad[:5]
        if ctx.keys_are_queries:
            k, need_k = q, need_q  # the keys' gradient is part of the queries'
        B, S, E = probs.shape
        blocks = _blocks(S, ctx.causal, ctx.block)
        grad_out = grad_out.contiguous()
        d_probs = torch.zeros_like(probs) if need_probs else None
        d_prior = torch.zeros_like(prior) if need_prior else None
        d_bias = probs.new_zeros(B, S) if need_bias else None
        # the score gradients dL of every block, in mm_dtype, laid out [B, query, key]: each key
        # block's gradient is then one product over the queries that see it (no sum over blocks);
        # only [i0:i1, :e] of each query block is written, and only that is read
        d_scores = probs.new_empty(B, S, S, dtype=q.dtype) if (need_q or need_k) else None
        d_q = q.new_empty(q.shape, dtype=torch.float32) if need_q else None  # cast to q's dtype at the end
        # softmax backward: dL_ij = W_ij (dW_ij - sum_k W_ik dW_ik) with dW = g R^T, and the row
        # term sum_k W_ik (g_i . R_k) = g_i . out_i (an [S, E] product instead of an [S, S] pass)
        row_terms = (grad_out * out).sum(-1, keepdim=True)
        need_dL = need_prior or need_bias  # the score gradients in fp32; else only in d_scores
        for (i0, i1, e), W in zip(blocks, weights):
            g = grad_out[:, i0:i1]
            if need_probs:
                d_probs[:, :e] += torch.bmm(W.transpose(1, 2), g)
            if not (need_dL or d_scores is not None):
                continue
            dW = torch.bmm(g, probs[:, :e].transpose(1, 2)).sub_(row_terms[:, i0:i1])
            dL = dW.mul_(W) if need_dL else None  # 0 where W is 0
            if d_scores is not None:
                if dL is None:  # the product written straight into the mm_dtype buffer
                    torch.mul(dW, W, out=d_scores[:, i0:i1, :e])
                else:
                    d_scores[:, i0:i1, :e] = dL
            if need_q:
                d_q[:, i0:i1] = torch.bmm(d_scores[:, i0:i1, :e], k[:, :e])
            if need_prior:
                p = prior[:, i0:i1, :e]
                d_prior[:, i0:i1, :e] = torch.where(p > 0, dL / p, torch.zeros_like(dL))
            if need_bias:
                d_bias[:, :e] += dL.sum(1)
        d_k = None
        if need_k:
            if not ctx.keys_are_queries:
                d_k = k.new_empty(k.shape, dtype=ctx.k_dtype)
            for j0, j1, _ in blocks:
                r0 = j0 if ctx.causal else 0  # the queries that see keys j0:j1
                part = torch.bmm(d_scores[:, r0:, j0:j1].transpose(1, 2), q[:, r0:])
                if ctx.keys_are_queries:
                    d_q[:, j0:j1] += part
                else:
                    d_k[:, j0:j1] = part
        for t in (d_q, d_k):
            if t is not None and ctx.scale != 1.0:
                t.mul_(ctx.scale)
        if d_q is not None:
            d_q = d_q.to(ctx.q_dtype)
        return d_probs, d_q, d_k, d_prior, d_bias, None, None, None, None, None, None


def dense_graph_weights(q: Optional[torch.Tensor], k: Optional[torch.Tensor], scale: float = 1.0,
                        prior: Optional[torch.Tensor] = None, key_bias: Optional[torch.Tensor] = None,
                        key_mask: Optional[torch.Tensor] = None, causal: bool = True,
                        entropy: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The mixing weights ``softmax_j(L_ij)`` ``[B, S, S]`` of :func:`mix_over_sequence` as one dense
    matrix (for inspection; the mixing step itself never forms it), in fp32, same masks."""
    ref = q if q is not None else prior
    B, S = ref.shape[0], ref.shape[1]
    with torch.no_grad():
        L = torch.zeros(B, S, S, device=ref.device)
        if q is not None:
            L = L + scale * torch.bmm(q.float(), k.float().transpose(1, 2))
        if prior is not None:
            L = L + torch.log(prior.float())
        if key_bias is not None:
            L = L + key_bias.float()[:, None, :]
        _keep_self_where_empty_(_entropy_mask_(_mask_block_(L, 0, causal, key_mask, float("-inf")), 0, entropy,
                                               float("-inf")), 0)
        return _softmax_(L, 0, causal, key_mask, entropy)


def mix_over_sequence(probs: torch.Tensor, q: Optional[torch.Tensor] = None, k: Optional[torch.Tensor] = None,
                      scale: float = 1.0, prior: Optional[torch.Tensor] = None, key_bias: Optional[torch.Tensor] = None,
                      padding_mask: Optional[torch.Tensor] = None, causal: bool = True, block: int = BLOCK,
                      mm_dtype: torch.dtype = torch.float32, entropy: Optional[torch.Tensor] = None,
                      observers: Sequence[Callable[..., None]] = ()) -> torch.Tensor:
    """The token-graph mixing step, ``P = softmax_j(L_ij) @ probs`` within each sequence, where
    ``L_ij = scale * q_i . k_j + log prior_ij + key_bias_j``.

    probs ``[B, S, E]``; q, k ``[B, S, D]`` or None (k None with q given: the keys are the
    queries, as in self-similarity); prior ``[B, S, S]`` probabilities or None
    (a zero prior excludes the key); key_bias ``[B, S]`` or None; padding_mask ``[B, S]`` (True =
    real; padded keys excluded, a token always sees itself); causal: keys after the query
    excluded (and never computed). fp32; gradients flow to every tensor input that needs them.
    mm_dtype: dtype of the ``q . k`` products and their gradients (bf16: rounded scores, the
    precision of a bf16 model's own attention; everything else stays fp32).
    entropy: ``[B, S]`` or None: a query mixes only keys of entropy at most its own (``mixing_set:
    lower_entropy``; no gradient).
    observers: callables that see the step (diagnostics): each is called as ``observer(probs=, q=,
    k=, scale=, prior=, key_bias=, key_mask=, causal=, mixed=, entropy=)`` under no_grad.
    """
    if q is None and prior is None:
        raise ValueError("mix_over_sequence needs q/k or a prior")
    km = None if padding_mask is None else padding_mask.to(device=probs.device, dtype=torch.bool)
    entropy = None if entropy is None else entropy.detach().float()
    mixed = _GraphMix.apply(probs, q, k, prior, key_bias, float(scale), km, bool(causal), int(block), mm_dtype, entropy)
    if observers:
        with torch.no_grad():
            for observe in observers:
                observe(probs=probs, q=q, k=q if k is None else k, scale=float(scale), prior=prior, key_bias=key_bias, key_mask=km,
                        causal=bool(causal), mixed=mixed, entropy=entropy)
    return mixed


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
        sqrt(d) or more, or ``cosine``, with it; timings in bench/results.md).
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
    for i0, i1, e in _blocks(S, causal, block):
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
# the scan's name in profiles (python -m moe_dist.bench.router --parts)
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
    with torch.profiler.record_function(ENTROPY_SCAN_RANGE):  # a named range for profilers (bench.router --parts)
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
        for i0, i1, e in _blocks(S, causal, block):
            s = torch.matmul(q[:, :, i0:i1], k[:, :, :e].transpose(-1, -2)).float()
            _mask_block_(s, i0, causal, mask, _SCAN_MASKED)
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
