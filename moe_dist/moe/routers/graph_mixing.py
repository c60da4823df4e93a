"""The token graph's mixing step: ``P = softmax_j(graph logits) @ R``, attention with ``v = R`` over the
tokens of one sequence (blockwise; causal blocks skip the keys after them), with its masks (padding
keys, the lower-entropy mixing set) and a hand-written backward. The routers that use it are
:mod:`moe_dist.moe.routers.token_graph`.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch


BLOCK = 128  # query rows per block: causal blocks skip the keys after the block (~half the work)


def query_blocks(S: int, causal: bool, block: int):
    """(first query, end query, end key) of each query block."""
    return [(i0, min(S, i0 + block), min(S, i0 + block) if causal else S) for i0 in range(0, S, block)]


def graph_values_per_token(S: int, causal: bool = True, block: int = BLOCK) -> float:
    """Mixing weights the graph keeps for backward per token of a length-``S`` sequence (fp32 values)."""
    return sum((i1 - i0) * e for i0, i1, e in query_blocks(S, causal, block)) / S


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
    _entropy_mask_(mask_block_(L, i0, causal, key_mask, 0.0), i0, entropy, 0.0)
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


def mask_block_(L: torch.Tensor, i0: int, causal: bool, key_mask: Optional[torch.Tensor], value: float) -> torch.Tensor:
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
        for i0, i1, e in query_blocks(S, causal, block):
            L = None
            if q is not None:
                L = torch.bmm(q[:, i0:i1], k[:, :e].transpose(1, 2)).float().mul_(scale)
            if prior is not None:
                log_prior = torch.log(prior[:, i0:i1, :e])  # exact -inf where the prior is 0
                L = log_prior if L is None else L.add_(log_prior)
            if key_bias is not None:
                L.add_(key_bias[:, None, :e])
            mask_block_(L, i0, causal, key_mask, neg)
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
        blocks = query_blocks(S, ctx.causal, ctx.block)
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
        _keep_self_where_empty_(_entropy_mask_(mask_block_(L, 0, causal, key_mask, float("-inf")), 0, entropy,
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
