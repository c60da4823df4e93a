"""Similarity- and Attention-aware routers: explicit references, causality, padding, and
1 process vs 2 / 4 gloo ranks (expert-parallel 2 / 4) with whole sequences per rank."""
import math

import pytest
import torch

from helpers.collective_count import record_collectives
from helpers.dist_harness import run_ranks
from helpers.moe_cases import D_MODEL, check_against_reference, collect, make_layer, step

from moe_dist.distributed import build_parallel_groups
from moe_dist.errors import ConfigError
from moe_dist.moe import MoEArgs, MoELayer
from moe_dist.moe.routers import build_router
from moe_dist.moe.routers.graph_mixing import dense_graph_weights, mix_over_sequence, routing_entropy
from moe_dist.moe.routing.types import AttentionInputs, RouterInputs, RoutingContext
from moe_dist.parallel import apply_expert_parallel, sync_gradients

E, K = 8, 2


# ---------------------------------------------------------------- synthetic inputs
def attention_inputs(B, S, H, Hkv, dh, D, seed, padding_mask=None, causal=True, scale=1.0, form="probs"):
    """Attention probabilities (causal, padded keys masked, diagonal always allowed) or, with
    ``form="scores"``, the queries and keys they would come from, and the value path the
    attention-aware router reads, as leaf tensors that require grad (keyed by the fields of
    AttentionInputs)."""
    g = torch.Generator().manual_seed(seed)
    if form == "scores":
        q, k = 1.5 * torch.randn(B, H, S, dh, generator=g), torch.randn(B, Hkv, S, dh, generator=g)
        return {"queries": q.requires_grad_(), "keys": k.requires_grad_(),
                **value_path(B, S, H, Hkv, dh, D, g, scale)}
    logits = 2.0 * torch.randn(B, H, S, S, generator=g)
    allowed = torch.ones(B, 1, S, S, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(S, S, dtype=torch.bool).tril()
    if padding_mask is not None:
        allowed &= padding_mask[:, None, None, :] | torch.eye(S, dtype=torch.bool)
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
    return {"probs": probs.requires_grad_(), **value_path(B, S, H, Hkv, dh, D, g, scale)}


def value_path(B, S, H, Hkv, dh, D, g, scale):
    values = scale * torch.randn(B, Hkv, S, dh, generator=g)
    w_out = scale * torch.randn(D, H * dh, generator=g) / math.sqrt(dh)
    out = scale * torch.randn(B, S, D, generator=g)
    return {"values": values.requires_grad_(), "out_weight": w_out.requires_grad_(), "output": out.requires_grad_()}


def probs_from_scores(attn, padding_mask, causal=True):
    """The attention probabilities the model would have formed from ``attn``'s queries and keys."""
    q, k = attn["queries"], attn["keys"]
    B, H, S, dh = q.shape
    allowed = torch.ones(B, 1, S, S, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(S, S, dtype=torch.bool).tril()
    if padding_mask is not None:
        allowed &= padding_mask[:, None, None, :] | torch.eye(S, dtype=torch.bool)
    s = q @ k.repeat_interleave(H // k.shape[1], 1).transpose(-1, -2) / math.sqrt(dh)
    return torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)


CTX = RoutingContext()  # a single process: what the layer owns does not matter to these routers


def inputs_for(B, S, attn=None, padding_mask=None, causal=True):
    """What a model hands the layer's forward for B sequences of S tokens (``attn``: a dict of
    AttentionInputs fields)."""
    return RouterInputs(batch_shape=(B, S), padding_mask=padding_mask, causal=causal,
                        attention=None if attn is None else AttentionInputs(**attn))


class CausalAttention(torch.nn.Module):
    """A tiny causal multi-head attention producing everything the attention-aware router reads."""

    def __init__(self, D, H, dh):
        super().__init__()
        self.H, self.dh = H, dh
        self.qkv = torch.nn.Linear(D, 3 * H * dh, bias=False)
        self.o = torch.nn.Linear(H * dh, D, bias=False)

    def forward(self, x):  # x [B, S, D]
        B, S, _ = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.H, self.dh).permute(2, 0, 3, 1, 4)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(self.dh)
        a = torch.softmax(s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")), -1)
        out = self.o((a @ v).transpose(1, 2).reshape(B, S, -1))
        return {"probs": a, "values": v, "out_weight": self.o.weight, "output": out}


# ---------------------------------------------------------------- references from the digest
def similarity_reference(u, R, tau, causal, padding_mask=None, cosine=False):
    """P = softmax_row(U U^T / tau) R per sequence, future keys and padded keys masked (float64)."""
    u = u.double()
    if cosine:
        u = u / u.norm(dim=-1, keepdim=True)
    L = u @ u.transpose(1, 2) / tau
    S = u.shape[1]
    allowed = torch.ones(u.shape[0], S, S, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(S, S, dtype=torch.bool).tril()
    if padding_mask is not None:
        allowed &= padding_mask[:, None, :] | torch.eye(S, dtype=torch.bool)
    return torch.softmax(L.masked_fill(~allowed, float("-inf")), -1) @ R.double()


def attention_reference(R, attn, sigma, out_scale, causal, padding_mask=None, likelihood=True):
    """Digest formulas, written out token by token: h* = argmin_h mean_i H(A_h[i, :]);
    L[i, j] = N(u_i | v'_{h*, j}, sigma^2 I) with v'_{h,j} = W_O,h v_{h,j}; A^P = A L / sum_j A L;
    P = A^P R (float64)."""
    A, values, w_out, u = (attn[k].double() for k in ("probs", "values", "out_weight", "output"))
    B, H, S, _ = A.shape
    Hkv, dh, D = values.shape[1], values.shape[-1], u.shape[-1]
    rows = []
    for b in range(B):
        real = [i for i in range(S) if padding_mask is None or bool(padding_mask[b, i])]
        mean_entropy = []
        for h in range(H):
            ent = [-sum(float(a) * math.log(float(a)) for a in A[b, h, i].detach() if a > 0) for i in real]
            mean_entropy.append(sum(ent) / len(ent))
        hs = min(range(H), key=lambda h: (mean_entropy[h], h))
        vp = values[b, hs // (H // Hkv)] @ w_out[:, hs * dh:(hs + 1) * dh].t()  # [S, D]
        for i in range(S):
            weights = []
            for j in range(S):
                ok = (j <= i or not causal) and (padding_mask is None or bool(padding_mask[b, j]) or j == i)
                lik = torch.exp(-((out_scale * u[b, i] - vp[j]) ** 2).sum() / (2 * sigma ** 2)) / (2 * math.pi * sigma ** 2) ** (D / 2)
                weights.append(A[b, hs, i, j] * (lik if likelihood else 1.0) if ok else A.new_zeros(()))
            w = torch.stack(weights)
            rows.append((w / w.sum()) @ R[b].double())
    return torch.stack(rows).view(B, S, -1)


def base_probs(router, x):
    return torch.softmax(x.double() @ router.base.weight.double().t(), -1)


# ---------------------------------------------------------------- single-process tests
@pytest.mark.parametrize("cosine,tau,pad", [(False, 4.0, False), (True, 0.25, True), (False, 1.0, True)])
def test_similarity_matches_reference(cosine, tau, pad):
    torch.manual_seed(0)
    B, S = 3, 7
    router = build_router("similarity", D_MODEL, E, K, temperature=tau, similarity="cosine" if cosine else "dot")
    x = torch.randn(B * S, D_MODEL, requires_grad=True)
    pm = None
    if pad:
        pm = torch.ones(B, S, dtype=torch.bool)
        pm[0, -2:] = False
        pm[2, :2] = False
    r = router(x, CTX, inputs_for(B, S, padding_mask=pm))
    P = similarity_reference(x.view(B, S, -1), base_probs(router, x).view(B, S, -1), tau, True, pm, cosine)
    torch.testing.assert_close(r.probs.double(), P.view(B * S, -1), rtol=1e-5, atol=1e-6)
    ids = P.view(B * S, -1).topk(K, -1).indices
    assert torch.equal(r.expert_ids, ids)
    gates = P.view(B * S, -1).gather(-1, ids)
    gates = gates / gates.sum(-1, keepdim=True)
    torch.testing.assert_close(r.gates.double(), gates, rtol=1e-5, atol=1e-6)
    c = torch.randn(B * S, K, dtype=torch.float64)
    gx, = torch.autograd.grad((r.gates.double() * c).sum(), x)
    x_ref = x.detach().clone().requires_grad_()
    P2 = similarity_reference(x_ref.view(B, S, -1), base_probs(router, x_ref).view(B, S, -1), tau, True, pm, cosine)
    g2 = P2.view(B * S, -1).gather(-1, ids)
    gx_ref, = torch.autograd.grad(((g2 / g2.sum(-1, keepdim=True)) * c).sum(), x_ref)
    torch.testing.assert_close(gx.double(), gx_ref.double(), rtol=1e-4, atol=1e-6)


def test_similarity_options():
    torch.manual_seed(1)
    B, S = 2, 6
    x = torch.randn(B * S, D_MODEL, requires_grad=True)
    inputs = inputs_for(B, S)
    fixed = build_router("similarity", D_MODEL, E, K, temperature=4.0)
    torch.manual_seed(1)
    learned = build_router("similarity", D_MODEL, E, K, temperature=4.0, learn_similarity=True)
    learned.base.load_state_dict(fixed.base.state_dict())
    torch.testing.assert_close(learned(x, CTX, inputs).gates, fixed(x, CTX, inputs).gates)  # W_s starts at I
    (learned(x, CTX, inputs).gates[:, 0].sum()).backward()
    assert learned.similarity_weight.grad is not None and learned.similarity_weight.grad.abs().sum() > 0
    # detach_graph: gradient reaches x only through R
    det = build_router("similarity", D_MODEL, E, K, temperature=4.0, detach_graph=True)
    det.base.load_state_dict(fixed.base.state_dict())
    c = torch.randn(B * S, K)
    g_det, = torch.autograd.grad((det(x, CTX, inputs).gates * c).sum(), x)
    xd = x.detach().clone().requires_grad_()
    with torch.no_grad():
        S_mat = torch.softmax((xd.view(B, S, -1) @ xd.view(B, S, -1).transpose(1, 2) / 4.0)
                              .masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf")), -1)
    P = S_mat @ torch.softmax(xd @ det.base.weight.t(), -1).view(B, S, -1)
    ids = det(x, CTX, inputs).expert_ids
    gate = P.view(B * S, -1).gather(-1, ids)
    g_ref, = torch.autograd.grad(((gate / gate.sum(-1, keepdim=True)) * c).sum(), xd)
    torch.testing.assert_close(g_det, g_ref, rtol=1e-4, atol=1e-6)
    g_full, = torch.autograd.grad((fixed(x, CTX, inputs).gates * c).sum(), x)
    assert not torch.allclose(g_full, g_det)  # the graph does carry gradient when not detached
    # top-1 keeps the un-normalised P[i, e*] (Switch style)
    top1 = build_router("similarity", D_MODEL, E, 1, temperature=4.0)
    r1 = top1(x, CTX, inputs)
    torch.testing.assert_close(r1.gates, r1.probs.gather(-1, r1.expert_ids))
    assert (r1.gates < 1).all()
    # the load-balance probabilities: mixed P by default, base R on request
    base_aux = build_router("similarity", D_MODEL, E, K, temperature=4.0, aux_probs="base")
    base_aux.base.load_state_dict(fixed.base.state_dict())
    torch.testing.assert_close(base_aux(x, CTX, inputs).probs, fixed.base(x, CTX, inputs).probs)


@pytest.mark.parametrize("sigma,likelihood,Hkv,pad,shared", [(1.0, True, 3, False, False), (0.7, True, 1, True, False),
                                                             (1.0, False, 3, True, False), (1.0, True, 3, False, True)])
def test_attention_matches_digest_formulas(sigma, likelihood, Hkv, pad, shared):
    """``shared``: both sequences have the same attention, so they pick the same head and W_O's
    slice for that head gets the sum of both sequences' gradients."""
    torch.manual_seed(2)
    B, S, H, dh, D = 2, 5, 3, 4, 6
    router = build_router("attention", D, 4, K, sigma=sigma, likelihood=likelihood)
    pm = None
    if pad:
        pm = torch.ones(B, S, dtype=torch.bool)
        pm[1, -1] = False
    attn = attention_inputs(B, S, H, Hkv, dh, D, seed=3, padding_mask=pm, scale=0.6)
    if shared:
        with torch.no_grad():
            for name, t in attn.items():
                if name != "out_weight":
                    t[1] = t[0]
    x = torch.randn(B * S, D, requires_grad=True)
    r = router(x, CTX, inputs_for(B, S, attn, pm))
    P = attention_reference(base_probs(router, x).view(B, S, -1), attn, sigma, 1.0 / H, True, pm, likelihood)
    torch.testing.assert_close(r.probs.double(), P.view(B * S, -1), rtol=1e-5, atol=1e-6)
    ids = P.view(B * S, -1).topk(K, -1).indices
    assert torch.equal(r.expert_ids, ids)
    if shared:
        assert int(r.extras["selected_heads"].max()) == B
    # gradients into the base router's input, the attention probabilities and the value path
    c = torch.randn(B * S, K, dtype=torch.float64)
    leaves = [x, *attn.values()]
    grads = torch.autograd.grad((r.gates.double() * c).sum(), leaves, allow_unused=True)
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    ref_attn = dict(zip(attn.keys(), ref_leaves[1:]))
    P2 = attention_reference(base_probs(router, ref_leaves[0]).view(B, S, -1), ref_attn, sigma, 1.0 / H, True, pm,
                             likelihood).view(B * S, -1).gather(-1, ids)
    ref_grads = torch.autograd.grad(((P2 / P2.sum(-1, keepdim=True)) * c).sum(), ref_leaves, allow_unused=True)
    for name, g, gr in zip(["x", *attn.keys()], grads, ref_grads):
        if gr is None:  # likelihood=False does not read the value path
            assert g is None or not g.abs().any(), name
            continue
        torch.testing.assert_close(g.double(), gr.double(), rtol=1e-4, atol=1e-7, msg=lambda m: f"grad {name}: {m}")
    # the likelihood term matters on this example (the check above can fail)
    if likelihood:
        plain = attention_reference(base_probs(router, x).view(B, S, -1), attn, sigma, 1.0 / H, True, pm, False)
        assert (plain - P).abs().max() > 1e-3


@pytest.mark.parametrize("likelihood,Hkv,pad,detach", [(True, 2, True, False), (False, 4, False, False),
                                                       (True, 1, False, True)])
def test_attention_scores_form_matches_probs_form(likelihood, Hkv, pad, detach):
    """What the model hands (queries and keys; the attention is never materialised) routes
    exactly as the probabilities those queries and keys give, with the same gradients into
    queries and keys (through the probabilities' softmax) and into the value path."""
    torch.manual_seed(4)
    B, S, H, dh, D = 3, 9, 4, 5, 8
    router = build_router("attention", D, 6, K, likelihood=likelihood, detach_graph=detach)
    pm = None
    if pad:
        pm = torch.ones(B, S, dtype=torch.bool)
        pm[0, -3:] = False
        pm[2, :2] = False
    scores = attention_inputs(B, S, H, Hkv, dh, D, seed=5, padding_mask=pm, scale=0.6, form="scores")
    x = torch.randn(B * S, D, requires_grad=True)
    leaves = [x, *scores.values()]
    c = torch.randn(B * S, K)
    results = {}
    for form in ("scores", "probs"):
        attn = dict(scores)
        if form == "probs":
            attn = {"probs": probs_from_scores(attn, pm), **{k: v for k, v in attn.items()
                                                             if k not in ("queries", "keys")}}
        r = router(x, CTX, inputs_for(B, S, attn, pm))
        loss = (r.gates * c).sum() + r.probs.pow(2).sum()
        results[form] = (r, torch.autograd.grad(loss, leaves, allow_unused=True))
    (r_s, g_s), (r_p, g_p) = results["scores"], results["probs"]
    assert torch.equal(r_s.expert_ids, r_p.expert_ids)
    assert torch.equal(r_s.extras["selected_heads"], r_p.extras["selected_heads"])
    torch.testing.assert_close(r_s.probs, r_p.probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r_s.gates, r_p.gates, rtol=1e-5, atol=1e-6)
    for name, a, b in zip(["x", *scores.keys()], g_s, g_p):
        if b is None:  # not read (likelihood=False) or detached
            assert a is None or not a.abs().any(), name
            continue
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {name}: {m}")
    graph_grads = [g for name, g in zip(["x", *scores.keys()], g_s) if name in ("queries", "keys")]
    assert all((g is None or not g.abs().any()) == detach for g in graph_grads)


@pytest.mark.parametrize("causal,pad,with_q,with_prior,self_keys",
                         [(True, True, True, True, False), (False, True, True, False, False),
                          (True, False, False, True, False), (False, False, True, True, False),
                          (True, True, True, False, True), (False, False, True, True, True)])
def test_blockwise_mixing_matches_dense(causal, pad, with_q, with_prior, self_keys):
    """The blockwise mixing step (blocks of 3 query rows over sequences of 10) against a dense
    float64 autograd computation, values and gradients of every input. ``self_keys``: k is left
    out, so the keys are the queries (the similarity router's case) and q's gradient holds both."""
    g = torch.Generator().manual_seed(7)
    B, S, Dq, Ex = 2, 10, 5, 4
    probs = torch.softmax(torch.randn(B, S, Ex, generator=g), -1).requires_grad_()
    q = torch.randn(B, S, Dq, generator=g).requires_grad_() if with_q else None
    k = torch.randn(B, S, Dq, generator=g).requires_grad_() if with_q and not self_keys else None
    bias = torch.randn(B, S, generator=g).requires_grad_() if with_q else None
    prior = None
    if with_prior:
        prior = torch.rand(B, S, S, generator=g)
        prior[0, 4, :] = 0.0  # a row with no prior mass keeps the token itself
        prior[1, :, 2] = 0.0  # a key the prior excludes
        prior.requires_grad_()
    pm = None
    if pad:
        pm = torch.ones(B, S, dtype=torch.bool)
        pm[0, 6:] = False
        pm[1, :2] = False
    leaves = [t for t in (probs, q, k, bias, prior) if t is not None]
    out = mix_over_sequence(probs, q, k, scale=0.7, prior=prior, key_bias=bias, padding_mask=pm, causal=causal, block=3)
    c = torch.randn(B, S, Ex, generator=g)
    grads = torch.autograd.grad((out * c).sum(), leaves)

    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(ref_leaves)
    r_probs = next(it)
    r_q = r_k = r_bias = None
    if with_q:
        r_q = next(it)
        r_k = r_q if self_keys else next(it)
        r_bias = next(it)
    r_prior = next(it) if with_prior else None
    allowed = torch.ones(B, S, S, dtype=torch.bool)
    if with_prior:
        allowed = allowed & (r_prior.detach() > 0)
    if causal:
        allowed = allowed & torch.ones(S, S, dtype=torch.bool).tril()
    if pad:
        allowed = allowed & (pm[:, None, :] | torch.eye(S, dtype=torch.bool))
    eye = torch.eye(S, dtype=torch.bool).expand(B, S, S)
    fallback = eye & ~allowed.any(-1, keepdim=True)  # empty rows: the token alone, logit 0
    L = torch.zeros(B, S, S, dtype=torch.float64)
    if with_q:
        L = L + 0.7 * r_q @ r_k.transpose(1, 2) + r_bias[:, None, :]
    if with_prior:
        L = L + torch.log(torch.where(allowed, r_prior, torch.ones_like(r_prior)))
    L = torch.where(allowed, L, torch.where(fallback, torch.zeros_like(L), torch.full_like(L, float("-inf"))))
    ref = torch.softmax(L, -1) @ r_probs
    ref_grads = torch.autograd.grad((ref * c.double()).sum(), ref_leaves)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for t, gr, gd in zip(leaves, grads, ref_grads):
        if t is prior:  # only where the prior has mass (elsewhere the key is simply excluded)
            gr, gd = gr[prior.detach() > 0], gd[prior.detach() > 0]
        torch.testing.assert_close(gr.double(), gd, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("causal,pad", [(True, True), (False, False)])
def test_mixing_set_restricted_to_lower_entropy(causal, pad):
    """mixing_set=lower_entropy (Prop. 1): token i mixes only keys j with H(r_j) <= H(r_i), values
    and gradients against a dense float64 reference; the least uncertain token keeps its own routing."""
    g = torch.Generator().manual_seed(5)
    B, S, Dq, Ex = 2, 10, 5, 4
    probs = torch.softmax(2 * torch.randn(B, S, Ex, generator=g), -1).requires_grad_()
    q = torch.randn(B, S, Dq, generator=g).requires_grad_()
    pm = None
    if pad:
        pm = torch.ones(B, S, dtype=torch.bool)
        pm[0, 7:] = False
    h = routing_entropy(probs)
    out = mix_over_sequence(probs, q, scale=0.7, padding_mask=pm, causal=causal, block=3, entropy=h)
    c = torch.randn(B, S, Ex, generator=g)
    grads = torch.autograd.grad((out * c).sum(), [probs, q])
    r_probs, r_q = (t.detach().double().requires_grad_() for t in (probs, q))
    allowed = h[:, None, :] <= h[:, :, None]
    if causal:
        allowed = allowed & torch.ones(S, S, dtype=torch.bool).tril()
    if pad:
        allowed = allowed & (pm[:, None, :] | torch.eye(S, dtype=torch.bool))
    L = (0.7 * r_q @ r_q.transpose(1, 2)).masked_fill(~allowed, float("-inf"))
    ref = torch.softmax(L, -1) @ r_probs
    ref_grads = torch.autograd.grad((ref * c.double()).sum(), [r_probs, r_q])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    for gr, gd in zip(grads, ref_grads):
        torch.testing.assert_close(gr.double(), gd, rtol=1e-4, atol=1e-6)
    lowest = h.argmin(-1)
    for b in range(B):
        torch.testing.assert_close(out[b, lowest[b]], probs[b, lowest[b]])
    full = mix_over_sequence(probs, q, scale=0.7, padding_mask=pm, causal=causal, block=3)
    assert not torch.allclose(full, out)
    W = dense_graph_weights(q, q, 0.7, key_mask=pm, causal=causal, entropy=h)
    assert bool((W[~allowed] == 0).all())


@pytest.mark.parametrize("name", ["similarity", "attention"])
def test_causality(name):
    """Changing token t+1 (and anything later) leaves the routing of tokens <= t unchanged;
    without the causal mask it does not (so the check can fail)."""
    torch.manual_seed(4)
    B, S, D, H, dh = 2, 9, D_MODEL, 2, 4
    opts = {"temperature": 4.0} if name == "similarity" else {}
    router = build_router(name, D, E, K, **opts)
    attn_layer = CausalAttention(D, H, dh)
    x = torch.randn(B, S, D)

    def route(inp, causal=True):
        attn = attn_layer(inp) if name == "attention" else None
        return router(inp.reshape(B * S, D), CTX, inputs_for(B, S, attn, causal=causal))

    for t in (0, 3, S - 2):
        x2 = x.clone()
        x2[:, t + 1:] = torch.randn(B, S - t - 1, D)
        a, b = route(x), route(x2)
        keep = torch.zeros(B, S, dtype=torch.bool)
        keep[:, : t + 1] = True
        keep = keep.reshape(-1)
        assert torch.equal(a.expert_ids[keep], b.expert_ids[keep])
        torch.testing.assert_close(a.gates[keep], b.gates[keep], rtol=0, atol=1e-7)
        torch.testing.assert_close(a.probs[keep], b.probs[keep], rtol=0, atol=1e-7)
    if name == "similarity":
        x2 = x.clone()
        x2[:, 1:] = torch.randn(B, S - 1, D)
        assert not torch.allclose(route(x, causal=False).probs[:1], route(x2, causal=False).probs[:1])


def test_padded_tokens_do_not_influence_real_tokens():
    torch.manual_seed(5)
    B, S = 2, 8
    pm = torch.ones(B, S, dtype=torch.bool)
    pm[0, 5:] = False
    router = build_router("similarity", D_MODEL, E, K, temperature=4.0, similarity="cosine")
    x = torch.randn(B, S, D_MODEL)
    x2 = x.clone()
    x2[0, 5:] = 10 * torch.randn(3, D_MODEL)
    for causal in (True, False):
        a = router(x.reshape(-1, D_MODEL), CTX, inputs_for(B, S, padding_mask=pm, causal=causal))
        b = router(x2.reshape(-1, D_MODEL), CTX, inputs_for(B, S, padding_mask=pm, causal=causal))
        real = pm.reshape(-1)
        torch.testing.assert_close(a.probs[real], b.probs[real], rtol=0, atol=1e-7)
        assert torch.equal(a.expert_ids[real], b.expert_ids[real])


def test_clear_errors():
    x = torch.randn(6, D_MODEL)
    with pytest.raises(ValueError, match="batch_shape"):
        build_router("similarity", D_MODEL, E, K)(x, CTX)
    with pytest.raises(ValueError, match="batch_shape"):
        build_router("similarity", D_MODEL, E, K)(x, CTX, RouterInputs(batch_shape=(2, 4)))
    with pytest.raises(ValueError, match="needs the attention sub-layer before its layer"):
        build_router("attention", D_MODEL, E, K)(x, CTX, RouterInputs(batch_shape=(2, 3)))
    probs = AttentionInputs(probs=torch.softmax(torch.randn(2, 2, 3, 3), -1))
    with pytest.raises(ValueError, match=r"likelihood=True needs the attention sub-layer's \['values', 'out_weight', 'output'\]"):
        build_router("attention", D_MODEL, E, K)(x, CTX, RouterInputs(batch_shape=(2, 3), attention=probs))
    build_router("attention", D_MODEL, E, K, likelihood=False)(x, CTX, RouterInputs(batch_shape=(2, 3), attention=probs))
    with pytest.raises(ValueError, match="base='symphony'.*allowed"):
        build_router("similarity", D_MODEL, E, K, base="symphony")
    with pytest.raises(ValueError, match="temperature"):
        build_router("similarity", D_MODEL, E, K, temperature=0)
    with pytest.raises(ValueError, match="similarity='l2'"):
        build_router("similarity", D_MODEL, E, K, similarity="l2")
    with pytest.raises(ValueError, match="sigma"):
        build_router("attention", D_MODEL, E, K, sigma=-1.0)
    with pytest.raises(ValueError, match="aux_probs"):
        build_router("attention", D_MODEL, E, K, aux_probs="raw")
    assert build_router("attention", D_MODEL, E, K).attention_needs == "scores"
    assert build_router("similarity", D_MODEL, E, K).attention_needs is None
    assert build_router("similarity", D_MODEL, E, K, base="noisy_topk").needs_token_layout


@pytest.mark.parametrize("router", ["similarity", "attention"])
def test_bf16_graph_products_track_fp32(router):
    """graph_dtype=bf16 runs the graph's q . k products (and the entropy scan's) in bf16: the scores
    are rounded to bf16, everything after them stays fp32. On inputs a bf16 model hands over (exact
    in bf16) it routes as the fp32 graph does, to bf16 precision, with gradients to match."""
    torch.manual_seed(7)
    B, S, H, Hkv, dh, D = 2, 40, 4, 2, 8, 32
    attn = attention_inputs(B, S, H, Hkv, dh, D, seed=8, scale=0.5, form="scores") if router == "attention" else None
    if attn is not None:
        attn = {k: v.detach().to(torch.bfloat16).float().requires_grad_(True) for k, v in attn.items()}
    x = (torch.randn(B * S, D) * 0.3).to(torch.bfloat16).float().requires_grad_(True)
    leaves = [x] + ([] if attn is None else list(attn.values()))
    c = torch.randn(B * S, K)
    options = {"temperature": 4.0} if router == "similarity" else {}
    out = {}
    for dtype in ("fp32", "bf16"):
        torch.manual_seed(9)
        r = build_router(router, D, E, K, graph_dtype=dtype, **options)
        routing = r(x, CTX, inputs_for(B, S, attn, None))
        loss = (routing.gates * c).sum() + routing.probs.pow(2).sum()
        out[dtype] = (routing, torch.autograd.grad(loss, leaves))
    (r32, g32), (r16, g16) = out["fp32"], out["bf16"]
    assert not torch.equal(r32.probs, r16.probs)  # the bf16 products ran
    torch.testing.assert_close(r16.probs, r32.probs, rtol=0, atol=5e-4)
    assert (r16.expert_ids == r32.expert_ids).float().mean() > 0.95
    if router == "attention":
        assert torch.equal(r16.extras["selected_heads"], r32.extras["selected_heads"])
    for a, b in zip(g16, g32):
        assert float((a - b).norm() / b.norm()) < 2e-2
    with pytest.raises(ConfigError, match=r"graph_dtype='fp16' is not allowed; allowed: \['fp32', 'bf16'\]"):
        build_router(router, D, E, K, graph_dtype="fp16")


def test_layer_extras_and_bf16_model():
    torch.manual_seed(6)
    layer = MoELayer(D_MODEL, MoEArgs(d_ff=32, num_experts=E, top_k=K, router="similarity",
                                      router_options={"temperature": 4.0, "base": "xmoe"}, expert_kernel="loop"))
    B, S = 3, 10
    inputs = RouterInputs(batch_shape=(B, S))
    x = torch.randn(B, S, D_MODEL, requires_grad=True)
    layer(x, inputs).sum().backward()
    extras = layer.stats.extras
    assert set(extras) >= {"topk_changed", "temperature"}
    assert 0 < float(extras["topk_changed"]) <= 1  # the mixing changed some choices
    assert not extras["topk_changed"].requires_grad
    layer.to(torch.bfloat16)
    out = layer(x.detach().to(torch.bfloat16), inputs)
    assert out.dtype == torch.bfloat16 and layer.last_routing.probs.dtype == torch.float32


# ---------------------------------------------------------------- 1 vs 2 vs 4 ranks
B_SEQ, S_LEN, HEADS, HEADS_KV, D_HEAD = 8, 12, 4, 2, 4

CASES = {
    "similarity": dict(cfg=dict(router="similarity", router_options={"temperature": 4.0}), causal=True, pad=True,
                       baseline="baseline-topk"),
    "similarity-cosine-xmoe-detach-cap": dict(cfg=dict(router="similarity", capacity_factor=1.0, drop_policy="probs",
                                                       router_options={"similarity": "cosine", "temperature": 0.1,
                                                                       "base": "xmoe", "detach_graph": True}),
                                              causal=False, pad=False, baseline="baseline-xmoe-cap"),
    "attention": dict(cfg=dict(router="attention"), causal=True, pad=True, baseline="baseline-topk"),
    "attention-scores": dict(cfg=dict(router="attention"), causal=True, pad=True, form="scores",
                             baseline="baseline-topk"),
    "attention-scores-bf16-graph": dict(cfg=dict(router="attention", router_options={"graph_dtype": "bf16"}),
                                        causal=True, pad=True, form="scores", baseline="baseline-topk"),
    "attention-top1-cap": dict(cfg=dict(router="attention", top_k=1, capacity_factor=1.25,
                                        router_options={"sigma": 2.0, "mixing_set": "lower_entropy"}), causal=True, pad=False,
                               baseline="baseline-top1-cap"),
    # the same layers with the plain base router: the collectives the layer issues anyway
    "baseline-topk": dict(cfg=dict(router="topk"), causal=True, pad=True),
    "baseline-xmoe-cap": dict(cfg=dict(router="xmoe", capacity_factor=1.0, drop_policy="probs"), causal=False, pad=False),
    "baseline-top1-cap": dict(cfg=dict(router="topk", top_k=1, capacity_factor=1.25), causal=True, pad=False),
}
SPLITS = {1: [[8]], 2: [[3, 5]], 4: [[1, 2, 3, 2]]}  # sequences per rank (uneven)


def case_data(spec):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(B_SEQ, S_LEN, D_MODEL, generator=g)
    w = torch.randn(B_SEQ, S_LEN, D_MODEL, generator=g)
    pm = None
    if spec["pad"]:
        pm = torch.ones(B_SEQ, S_LEN, dtype=torch.bool)
        pm[1, -4:] = False
        pm[6, :3] = False
    attn = None
    if spec["cfg"]["router"] == "attention":
        attn = attention_inputs(B_SEQ, S_LEN, HEADS, HEADS_KV, D_HEAD, D_MODEL, seed=12, padding_mask=pm,
                                causal=spec["causal"], scale=0.5, form=spec.get("form", "probs"))
    return x, w, pm, attn


def run_case(rank, spec, ep, sizes):
    """One forward/backward of the layer on this rank's whole sequences (ranks: sizes)."""
    cfg = spec["cfg"]
    groups = build_parallel_groups(ep, cfg.get("num_experts", E))
    layer = apply_expert_parallel(make_layer(cfg), groups)
    x, w, pm, attn = case_data(spec)
    b0, nb = sum(sizes[:rank]), sizes[rank]
    sl = slice(b0, b0 + nb)
    mine = None if attn is None else {k: (v if k == "out_weight" else v[sl]) for k, v in attn.items()}
    inputs = inputs_for(nb, S_LEN, mine, None if pm is None else pm[sl], spec["causal"])
    with record_collectives() as calls:
        res = step(layer, x[sl].reshape(-1, D_MODEL), w[sl].reshape(-1, D_MODEL), B_SEQ * S_LEN, inputs)
    sync_gradients(layer, groups)
    res = collect(layer, res)
    res["collectives"] = [(n, dt) for n, _, dt in calls]
    res["topk_changed"] = layer.stats.extras.get("topk_changed", torch.zeros(()))
    if attn is not None:  # per-sequence inputs: this rank's rows; W_O: this rank's partial gradient
        res["attn_grads"] = {k: v.grad.clone() for k, v in attn.items()}
    return res


def _all_cases(rank, world, ep):
    return {(name, i): run_case(rank, spec, ep, sizes)
            for name, spec in CASES.items() for i, sizes in enumerate(SPLITS[world])}


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4)])
def test_token_graph_invariance_and_collectives(world, ep):
    results = run_ranks(_all_cases, world, args=(ep,))
    tokens = B_SEQ * S_LEN
    for name, spec in CASES.items():
        ref = run_case(0, spec, 1, SPLITS[1][0])
        if "baseline" in spec:
            assert float(ref["topk_changed"]) > 0, f"{name}: the mixing changed no choice; the case checks nothing"
        for i, sizes in enumerate(SPLITS[world]):
            per_rank = [r[(name, i)] for r in results]
            check_against_reference(ref, per_rank, tokens)
            if "attn_grads" in ref:
                for key, g_ref in ref["attn_grads"].items():
                    if key == "out_weight":  # a dense parameter: partial gradients sum over ranks
                        got = torch.stack([r["attn_grads"][key] for r in per_rank]).sum(0)
                    else:
                        got = torch.cat([r["attn_grads"][key][sum(sizes[:j]):sum(sizes[:j]) + sizes[j]]
                                         for j, r in enumerate(per_rank)])
                    torch.testing.assert_close(got, g_ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {key}: {m}")
            # no collective beyond the layer's own: the same calls as the plain top-k layer
            if "baseline" in spec:
                for r_case, r in zip(per_rank, results):
                    # the recorder works: the statistics all-gather and the dispatch all-to-alls are there
                    assert {c[0] for c in r_case["collectives"]} >= {"all_gather_single", "all_to_all_single"}
                    assert r_case["collectives"] == r[(spec["baseline"], i)]["collectives"], name
