"""SymphonySMoE: routing with A @ softmax, integer co-selection counts, the per-step graph
update (hand-computed), fp32 buffer under casts, no counting in eval / recomputation, and
1 process vs 2 / 4 gloo ranks over several optimizer steps (A bit-identical everywhere)."""
import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from helpers.collective_count import record_collectives
from helpers.dist_harness import run_ranks
from helpers.moe_cases import D_MODEL, check_against_reference, collect, make_batch, make_layer, split_sizes, step

from moe_dist.distributed import build_parallel_groups
from moe_dist.moe import MoEArgs, MoELayer
from moe_dist.moe.routers import build_router
from moe_dist.moe.routing.types import RouterInputs, RoutingContext
from moe_dist.parallel import apply_expert_parallel, sync_gradients

E, K = 8, 2


def crafted_router(num_experts=3, **opts):
    """Base logits = 10 * x: the chosen experts are the two largest input coordinates."""
    r = build_router("symphony", num_experts, num_experts, 2, **opts)
    with torch.no_grad():
        r.base.weight.copy_(10 * torch.eye(num_experts))
    return r


# tokens choosing {0,1}, {1,2}, {0,1}
X3 = torch.tensor([[1.0, 0.5, 0.0], [0.0, 1.0, 0.5], [1.0, 0.6, 0.0]])
C3 = torch.tensor([[2, 2, 0], [2, 3, 1], [0, 1, 1]])  # ordered pairs of each token's top-2, diagonal included


def test_routing_is_graph_times_softmax():
    torch.manual_seed(0)
    r = build_router("symphony", D_MODEL, E, K, normalize=False)  # the paper's gates
    with torch.no_grad():
        r.A.copy_(torch.rand(E, E))
    x = torch.randn(20, D_MODEL, requires_grad=True)
    out = r(x, RoutingContext())
    s = torch.softmax(x.double() @ r.base.weight.double().t(), -1)
    g = s @ r.A.double().t()
    ids = g.topk(K, -1).indices
    assert torch.equal(out.expert_ids, ids)
    torch.testing.assert_close(out.gates.double(), g.gather(-1, ids))  # normalize=false: g itself
    torch.testing.assert_close(out.probs.double(), s)  # the aux loss sees the base softmax
    out.gates.sum().backward()
    assert x.grad.abs().sum() > 0
    rn = build_router("symphony", D_MODEL, E, K)  # default at top-2: the gate rule renormalises
    rn.load_state_dict(r.state_dict())
    gn = rn(x, RoutingContext()).gates
    torch.testing.assert_close(gn.sum(-1), torch.ones(20))
    torch.testing.assert_close(gn.double(), g.gather(-1, ids) / g.gather(-1, ids).sum(-1, keepdim=True))
    assert rn.renormalizes_gates and not r.renormalizes_gates
    top1 = build_router("symphony", D_MODEL, E, 1)  # top-1 keeps the raw gate, as every router does
    assert not top1.renormalizes_gates


def test_initial_graphs():
    torch.manual_seed(1)
    x = torch.randn(30, D_MODEL)
    zero = build_router("symphony", D_MODEL, E, K)
    base = zero.base(x, RoutingContext())
    out = zero(x, RoutingContext())
    assert torch.equal(out.expert_ids, base.expert_ids)  # ties broken by the base probabilities
    assert not out.gates.any()  # paper: zero graph, zero gates at the first step
    ident = build_router("symphony", D_MODEL, E, K, init="identity")
    ident.base.load_state_dict(zero.base.state_dict())
    o = ident(x, RoutingContext())
    plain = build_router("topk", D_MODEL, E, K)  # both renormalise at top-2 by default
    plain.load_state_dict(zero.base.state_dict())
    p = plain(x, RoutingContext())
    assert torch.equal(o.expert_ids, p.expert_ids)
    torch.testing.assert_close(o.gates, p.gates)


def test_counts_and_update_by_hand():
    r = crafted_router()
    r.train()
    r(X3, RoutingContext())
    assert r.pending_counts().dtype == torch.int64
    assert torch.equal(r.pending_counts(), C3)
    r.after_optimizer_step(RoutingContext())
    rownorm = torch.tensor([[2 / 4, 2 / 4, 0], [2 / 6, 3 / 6, 1 / 6], [0, 1 / 2, 1 / 2]])
    torch.testing.assert_close(r.A, 0.1 * rownorm, rtol=0, atol=1e-7)
    assert int(r.n_updates) == 1 and r._counts is None
    # two micro-batches accumulate before one update: second update adds 0.1 * rownorm again
    r(X3[:2], RoutingContext())
    r(X3[2:], RoutingContext())
    assert torch.equal(r.pending_counts(), C3)
    r.after_optimizer_step(RoutingContext())
    torch.testing.assert_close(r.A, (0.9 * 0.1 + 0.1) * rownorm, rtol=0, atol=1e-7)
    # padding tokens are not counted
    r(X3, RoutingContext(), RouterInputs(batch_shape=(1, 3), padding_mask=torch.tensor([[True, False, True]])))
    assert torch.equal(r.pending_counts(), torch.tensor([[2, 2, 0], [2, 2, 0], [0, 0, 0]]))


def test_normalisations_by_hand():
    # row sums d = (4, 6, 2); column: C[j, k] / d_k; symmetric: C[j, k] / sqrt(d_j d_k)
    col = torch.tensor([[2 / 4, 2 / 6, 0], [2 / 4, 3 / 6, 1 / 2], [0, 1 / 6, 1 / 2]])
    sym = torch.tensor([[2 / 4, 2 / math.sqrt(24), 0], [2 / math.sqrt(24), 3 / 6, 1 / math.sqrt(12)],
                        [0, 1 / math.sqrt(12), 1 / 2]])
    for how, want in (("column", col), ("symmetric", sym)):
        r = crafted_router(normalization=how, beta=0.5)
        r(X3, RoutingContext())
        r.after_optimizer_step(RoutingContext())
        torch.testing.assert_close(r.A, 0.5 * want, rtol=0, atol=1e-7, msg=lambda m: f"{how}: {m}")


def test_never_selected_rows_unchanged_and_eval_frozen():
    r = crafted_router(num_experts=4, init="identity")
    x = torch.cat([X3, torch.zeros(3, 1)], 1)  # expert 3 is never chosen
    r(x, RoutingContext())
    r.after_optimizer_step(RoutingContext())
    assert torch.equal(r.A[3], torch.tensor([0.0, 0.0, 0.0, 1.0]))
    assert not torch.equal(r.A[0], torch.tensor([1.0, 0.0, 0.0, 0.0]))
    frozen = r.A.clone()
    r.eval()
    r(x, RoutingContext())
    assert r._counts is None
    r.after_optimizer_step(RoutingContext())  # nothing counted: no row moves
    assert torch.equal(r.A, frozen)


def test_bias_correction():
    r = crafted_router(bias_correction=True)
    for _ in range(3):
        r(X3, RoutingContext())
        r.after_optimizer_step(RoutingContext())
    rownorm = torch.tensor([[2 / 4, 2 / 4, 0], [2 / 6, 3 / 6, 1 / 6], [0, 1 / 2, 1 / 2]])
    torch.testing.assert_close(r.expert_graph(), rownorm, rtol=0, atol=1e-6)  # (1 - 0.9^3) A / (1 - 0.9^3)
    with pytest.raises(ValueError, match="bias_correction"):
        build_router("symphony", D_MODEL, E, K, bias_correction=True, init="identity")


@pytest.mark.parametrize("reentrant", [False, True])
def test_recomputation_does_not_count_twice(reentrant):
    torch.manual_seed(2)
    layer = MoELayer(D_MODEL, MoEArgs(d_ff=32, num_experts=E, top_k=K, router="symphony",
                                      router_options={"init": "identity"}, expert_kernel="loop"))
    x = torch.randn(40, D_MODEL, requires_grad=True)
    layer(x)
    once = layer.router.pending_counts().clone()
    layer.router._counts = None
    out = checkpoint(layer, x, use_reentrant=reentrant)
    out.sum().backward()
    assert torch.equal(layer.router.pending_counts(), once)
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_graph_stays_fp32_under_casts_and_in_state_dict():
    torch.manual_seed(3)
    layer = MoELayer(D_MODEL, MoEArgs(d_ff=32, num_experts=E, top_k=K, router="symphony", expert_kernel="loop"))
    with torch.no_grad():
        layer.router.A.copy_(torch.rand(E, E) / 3)  # values with low mantissa bits bf16 would lose
    layer.router.n_updates.fill_(5)
    A = layer.router.A.clone()
    layer.router(torch.randn(4, D_MODEL), RoutingContext())  # pending counts survive the cast
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double(), lambda m: m.float()):
        cast(layer)
        assert layer.router.A.dtype == torch.float32 and torch.equal(layer.router.A, A)
    layer.to(torch.bfloat16)
    assert layer.router.base.weight.dtype == torch.bfloat16
    assert layer.router.pending_counts().dtype == torch.int64
    sd = layer.state_dict()
    assert sd["router.A"].dtype == torch.float32 and torch.equal(sd["router.A"], A)
    assert int(sd["router.n_updates"]) == 5 and not any("count" in k for k in sd)
    fresh = MoELayer(D_MODEL, MoEArgs(d_ff=32, num_experts=E, top_k=K, router="symphony",
                                      expert_kernel="loop")).to(torch.bfloat16)
    fresh.load_state_dict(sd)
    assert fresh.router.A.dtype == torch.float32 and torch.equal(fresh.router.A, A)
    out = fresh(torch.randn(6, D_MODEL, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    with torch.device("meta"):
        meta = build_router("symphony", D_MODEL, E, K).to(torch.bfloat16)
    meta.to_empty(device="cpu")
    assert meta.A.dtype == torch.float32 and meta.A.device.type == "cpu"


def test_options_errors_and_metrics():
    for key, bad in (("init", "xavier"), ("normalization", "doubly"), ("count_source", "final_topk"), ("scope", "world")):
        with pytest.raises(ValueError, match=f"{key}='{bad}'.*allowed"):
            build_router("symphony", D_MODEL, E, K, **{key: bad})
    with pytest.raises(ValueError, match="beta"):
        build_router("symphony", D_MODEL, E, K, beta=1.0)
    with pytest.raises(ValueError, match="base='similarity'"):
        build_router("symphony", D_MODEL, E, K, base="similarity")
    r = crafted_router()
    r(X3, RoutingContext())
    r.after_optimizer_step(RoutingContext())
    m = r.extra_metrics()
    assert m["graph_updates"] == 1 and m["graph_empty_rows"] == 0
    assert abs(m["graph_row_sum_mean"] - 0.1) < 1e-6 and m["graph_asymmetry"] > 0


# ---------------------------------------------------------------- 1 vs 2 vs 4 ranks, several steps
TOKENS, STEPS, MICRO, LR = 48, 3, 2, 0.5
CASES = {
    "symphony-zero-row": dict(cfg=dict(router="symphony"), baseline="baseline-topk"),
    "symphony-identity-column-xmoe-cap": dict(
        cfg=dict(router="symphony", capacity_factor=1.0, drop_policy="probs",
                 router_options={"init": "identity", "normalization": "column", "base": "xmoe",
                                 "base_options": {"init_temperature": 0.3}}),
        baseline="baseline-xmoe-cap"),
    "symphony-top1-symmetric-final-biascorr": dict(
        cfg=dict(router="symphony", top_k=1, router_options={"normalization": "symmetric", "count_source": "final",
                                                             "bias_correction": True}),
        baseline="baseline-topk"),
    "symphony-local": dict(cfg=dict(router="symphony", router_options={"scope": "local"}), baseline="baseline-topk"),
    "baseline-topk": dict(cfg=dict(router="topk")),
    "baseline-xmoe-cap": dict(cfg=dict(router="xmoe", capacity_factor=1.0, drop_policy="probs")),
}


def train_steps(rank, world, cfg, ep, uneven):
    """STEPS optimizer steps of MICRO micro-batches each (SGD), then the router hook."""
    groups = build_parallel_groups(ep, E)
    layer = apply_expert_parallel(make_layer(cfg), groups)
    sizes = split_sizes(TOKENS, world, uneven)
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank]) + sizes[rank])
    history = []
    for s in range(STEPS):
        layer.zero_grad(set_to_none=True)
        with record_collectives() as fwd_calls:
            for m in range(MICRO):
                layer.context.step, layer.context.micro_step = s, m
                x, w = make_batch(TOKENS, seed=100 + 10 * s + m)
                res = step(layer, x[mine], w[mine], TOKENS * MICRO)
        sync_gradients(layer, groups)
        res = collect(layer, res)
        with torch.no_grad():
            for p in layer.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
        with record_collectives() as hook_calls:
            layer.router.after_optimizer_step(layer.context)
        res["fwd_calls"] = [(n, dt) for n, _, dt in fwd_calls]
        res["hook_calls"] = list(hook_calls)
        if hasattr(layer.router, "A"):
            res["A"] = layer.router.A.clone()
        history.append(res)
    return history


def _all_cases(rank, world, ep):  # uneven token splits (the even split is the easy special case)
    return {name: train_steps(rank, world, spec["cfg"], ep, True) for name, spec in CASES.items()}


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4)])
def test_symphony_invariance_over_steps(world, ep):
    results = run_ranks(_all_cases, world, args=(ep,))
    for name, spec in CASES.items():
        if "baseline" not in spec:
            continue
        ref = train_steps(0, 1, spec["cfg"], 1, False)
        local = spec["cfg"].get("router_options", {}).get("scope") == "local"
        assert ref[-1]["A"].abs().sum() > 0
        per_rank = [r[name] for r in results]
        base_runs = [r[spec["baseline"]] for r in results]
        for s in range(STEPS):
            steps_s = [h[s] for h in per_rank]
            for h, b in zip(steps_s, base_runs):
                # forward/backward: exactly the layer's own collectives
                assert h["fwd_calls"] == b[s]["fwd_calls"], name
                assert b[s]["hook_calls"] == []
                # the hook: one all-reduce of E*E int64 counts (none with scope local)
                assert h["hook_calls"] == ([] if local else [("all_reduce", E * E, "torch.int64")]), name
            if local:
                continue
            # (outputs of the step's last micro-batch, gradients accumulated over the step)
            check_against_reference(ref[s], steps_s, TOKENS)
            for h in steps_s:
                assert torch.equal(h["A"], ref[s]["A"]), f"{name} step {s}: A differs from one process"
        if local:  # per-rank graphs: they differ between ranks and from the global graph
            As = [h[-1]["A"] for h in per_rank]
            assert any(not torch.equal(As[0], a) for a in As[1:])
            assert all(not torch.equal(a, ref[-1]["A"]) for a in As)
