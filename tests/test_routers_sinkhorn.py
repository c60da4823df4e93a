"""Selective Sinkhorn routing (ssr) and the every-call Sinkhorn baseline (sinkhorn):
distributed exactness (1 process vs 2 and 4 gloo ranks), global marginals, a shared stop
iteration on very different per-rank data, the kernel's sign, coins and gradients."""
import pytest
import torch

from helpers.dist_harness import run_ranks
from helpers.router_cases import SPAWN, TOKENS, build_jobs, check_calls, differs, per_job, reference_calls, run_layouts
from moe_dist.distributed.collectives import all_reduce_sum
from moe_dist.moe import MoEArgs, MoELayer
from moe_dist.moe.routers import build_router
from moe_dist.moe.routers.sinkhorn import sinkhorn_dual, transport_plan
from moe_dist.moe.routers.ssr import SelectiveSinkhornRouter
from moe_dist.moe.routing.types import RoutingContext

E = 8
NO_AUX = dict(aux_loss_coef=0.0, z_loss_coef=0.0)


def _coin_steps(p: float, seed: int = 7, layer: int = 0) -> list:
    """Two steps whose coin says Sinkhorn and two that say softmax (found, not assumed)."""
    router = build_router("ssr", 16, E, 2, p=p)
    hits = [s for s in range(200) if router.uses_sinkhorn(RoutingContext(step=s, seed=seed, layer_idx=layer))]
    misses = [s for s in range(200) if s not in hits]
    return hits[:2] + misses[:2]


CASES = {
    "ssr-plan": (dict(router="ssr", router_options=dict(p=1.0, init_std=0.3), **NO_AUX),
                 [dict(step=0), dict(step=1, micro_step=1), dict(train=False)]),
    "ssr-S-noise-coin": (dict(router="ssr", router_options=dict(p=0.5, cost="softmax", noise_alpha=1.0, init_std=0.3)),
                         [dict(step=s) for s in _coin_steps(0.5)] + [dict(train=False)]),
    # the eval call routes by the plan of the evaluated batch (inference: sinkhorn); a trained gate bias
    "sinkhorn-small-xi-cap": (dict(router="sinkhorn", router_options=dict(xi=0.05, init_std=0.3, inference="sinkhorn",
                                                                            gate_bias=True),
                                   capacity_factor=1.0),
                              [dict(step=0), dict(train=False)]),
}
LOCAL_CASES = {  # must differ from one process (the test can fail)
    "ssr-local": (dict(router="ssr", router_options=dict(p=1.0, init_std=0.3, scope="local"), **NO_AUX), [dict(step=0)]),
}
EP_CASE = ("ssr-ep", (dict(router="ssr", router_options=dict(p=1.0, init_std=0.3, scope="ep"), **NO_AUX), [dict(step=0)]))


def strongly_skewed_scores(tokens: int = TOKENS) -> torch.Tensor:
    """Four blocks of tokens with very different score scales and preferred experts: each block
    alone balances after a very different number of Sinkhorn iterations."""
    g = torch.Generator().manual_seed(3)
    blocks = []
    for b in range(4):
        block = torch.randn(tokens // 4, E, generator=g) * (0.2 + 3.0 * b)
        block[:, b] += 4.0 * b
        blocks.append(block)
    return torch.cat(blocks)


def _solver_checks(rank, world, group):
    scores = strongly_skewed_scores()
    n = scores.shape[0] // world
    mine = scores[rank * n : (rank + 1) * n]
    out = {}
    res = sinkhorn_dual(mine, group=group, max_iters=500, tol=1e-4)
    plan = transport_plan(mine, res.dual)
    out["global"] = dict(iters=int(res.iterations), error=float(res.error), dual=res.dual,
                         cols=all_reduce_sum(plan.sum(0), group), rows=plan.sum(1))
    local = sinkhorn_dual(mine, group=None, max_iters=500, tol=1e-4)
    out["local_iters"] = int(local.iterations)
    capped = sinkhorn_dual(mine, group=group, max_iters=3, tol=1e-4)
    out["capped"] = dict(iters=int(capped.iterations), error=float(capped.error))
    weights = torch.ones(mine.shape[0])
    weights[::3] = 0.0  # padding rows
    padded = sinkhorn_dual(mine, group=group, max_iters=500, tol=1e-4, row_weight=weights)
    pplan = transport_plan(mine, padded.dual) * weights[:, None]
    out["padded"] = dict(cols=all_reduce_sum(pplan.sum(0), group), tokens=float(padded.tokens))
    return out


def _rank_main(rank, world):
    jobs = build_jobs()
    results = run_layouts(jobs, {**CASES, **LOCAL_CASES, EP_CASE[0]: EP_CASE[1]})
    for (ranks, ep), job in jobs.items():
        if ranks == ep:
            results[("solver", ranks)] = _solver_checks(job.rank, ranks, job.group)
    return results


def _check_solver(solver: list, world: int) -> None:
    scores = strongly_skewed_scores()
    one = sinkhorn_dual(scores, max_iters=500, tol=1e-4)
    target = scores.shape[0] / E
    iters = [s["global"]["iters"] for s in solver]
    assert len(set(iters)) == 1, f"ranks stopped at different iterations: {iters}"
    assert abs(iters[0] - int(one.iterations)) <= 1, (iters[0], int(one.iterations))
    assert iters[0] < 500 and solver[0]["global"]["error"] < 1e-4
    local_iters = [s["local_iters"] for s in solver]
    assert len(set(local_iters)) > 1, f"test data should make per-rank solves differ: {local_iters}"
    for s in solver:
        torch.testing.assert_close(s["global"]["cols"], torch.full((E,), target), rtol=1e-4, atol=0.0)
        torch.testing.assert_close(s["global"]["rows"], torch.ones_like(s["global"]["rows"]))
        torch.testing.assert_close(s["global"]["dual"] - s["global"]["dual"].mean(), one.dual - one.dual.mean(),
                                   rtol=1e-3, atol=2e-4)
        assert s["capped"]["iters"] == 3 and s["capped"]["error"] > 1e-4
        real = sum(1 for i in range(scores.shape[0] // world) if i % 3) * world
        assert s["padded"]["tokens"] == real
        torch.testing.assert_close(s["padded"]["cols"], torch.full((E,), real / E), rtol=1e-4, atol=0.0)


def test_ssr_distributed():
    # one spawn runs every layout (4 ranks ep 4 and ep 2; two 2-rank jobs); a short collective
    # timeout turns a hang into a failure
    results = run_ranks(_rank_main, SPAWN, args=(), timeout=60)
    for name, (cfg, calls) in CASES.items():
        ref = reference_calls(cfg, calls)
        for _, label, per_rank in per_job(results, lambda r, e, u: (name, r, e, u)):
            check_calls(ref, per_rank, f"{name} {label}")
    ref = reference_calls(*CASES["sinkhorn-small-xi-cap"])
    assert float(ref[1]["extras"]["sinkhorn_calls"]) == 1.0  # eval mode solved the plan
    assert int(ref[1]["state"]["sinkhorn_calls_total"]) == 1  # the counters count training calls only
    ref = reference_calls(*CASES["ssr-S-noise-coin"])
    assert [float(c["extras"]["sinkhorn_calls"]) for c in ref[:4]] == [1.0, 1.0, 0.0, 0.0]
    for name, (cfg, calls) in LOCAL_CASES.items():
        ref = reference_calls(cfg, calls)
        for _, label, per_rank in per_job(results, lambda r, e, u: (name, r, e, u)):
            assert differs(ref, per_rank), f"{name} {label}: local plan equals global"
    name, (cfg, calls) = EP_CASE
    ref = reference_calls(cfg, calls)
    for (ranks, ep, _), label, per_rank in per_job(results, lambda r, e, u: (name, r, e, u)):
        if ep == ranks:  # the ep group holds every rank of the job: same as global
            check_calls(ref, per_rank, f"{name} {label}")
        else:
            assert differs(ref, per_rank), f"{name} {label}: ep < ranks should differ from one process"
    for ranks in (4, 2):
        for start in range(0, SPAWN, ranks):
            _check_solver([r[("solver", ranks)] for r in results[start : start + ranks]], ranks)


# ---- single process ---------------------------------------------------------------------------

def _load_cv(expert_ids: torch.Tensor) -> float:
    counts = torch.bincount(expert_ids.reshape(-1), minlength=E).float()
    return float(counts.std() / counts.mean())


def test_inference_by_the_plan_is_balanced():
    """inference: sinkhorn routes eval batches by the plan (balanced where softmax top-k is
    skewed), with the softmax gates at the experts it chose; inference: topk is the default."""
    torch.manual_seed(0)
    topk_eval = build_router("sinkhorn", 16, E, 2, init_std=0.5)
    plan_eval = build_router("sinkhorn", 16, E, 2, init_std=0.5, inference="sinkhorn")
    plan_eval.load_state_dict(topk_eval.state_dict())
    x = torch.randn(512, 16) + 2.0 * torch.randn(16)  # a shared offset: the raw scores favour a few experts
    for r in (topk_eval, plan_eval):
        r.eval()
    plain = topk_eval(x, RoutingContext())
    balanced = plan_eval(x, RoutingContext())
    assert torch.equal(plain.expert_ids, plain.probs.topk(2, -1).indices)
    assert _load_cv(plain.expert_ids) > 0.5 and _load_cv(balanced.expert_ids) < 0.5 * _load_cv(plain.expert_ids)
    expect = balanced.probs.gather(-1, balanced.expert_ids)
    torch.testing.assert_close(balanced.gates, expect / expect.sum(-1, keepdim=True))
    assert int(plan_eval.sinkhorn_calls_total) == 0
    with pytest.raises(ValueError, match="router_options.inference"):
        build_router("sinkhorn", 16, E, 2, inference="plan")


def test_gate_bias_trains_and_shifts_the_scores():
    torch.manual_seed(0)
    router = build_router("sinkhorn", 16, E, 2, gate_bias=True)
    x = torch.randn(64, 16)
    with torch.no_grad():
        router.gate_bias.copy_(torch.linspace(-1, 1, E))
    routing = router(x, RoutingContext())
    torch.testing.assert_close(routing.logits, x @ router.weight.detach().t() + router.gate_bias.detach())
    routing.gates.sum().backward()  # the gates are the softmax at the chosen experts: the bias trains
    assert router.gate_bias.grad is not None and router.gate_bias.grad.abs().sum() > 0
    assert "gate_bias" not in build_router("sinkhorn", 16, E, 2).state_dict()


def test_plan_prefers_high_scores():
    # each expert is the clear favourite of N/E tokens: the balanced plan keeps every favourite
    # (a kernel with the wrong sign, exp(-C/xi), would pick each token's least liked expert)
    g = torch.Generator().manual_seed(0)
    favourite = torch.arange(96) % E
    scores = torch.randn(96, E, generator=g) * 0.1
    scores[torch.arange(96), favourite] += 2.0
    res = sinkhorn_dual(scores / 0.5)
    plan = transport_plan(scores / 0.5, res.dual)
    assert torch.equal(plan.argmax(-1), favourite)
    assert (plan[torch.arange(96), favourite] > 0.5).all()
    # unstructured scores: the plan still puts more than 1/E on each token's best expert on
    # average, and less than 1/E on its worst
    scores = torch.randn(96, E, generator=g)
    plan = transport_plan(scores / 0.5, sinkhorn_dual(scores / 0.5).dual)
    assert plan.gather(1, scores.argmax(-1, keepdim=True)).mean() > 2.0 / E
    assert plan.gather(1, scores.argmin(-1, keepdim=True)).mean() < 0.5 / E


def test_marginals_and_small_xi_stay_finite():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(256, E, generator=g) * 3.0 / 0.05  # SSR-L at xi=0.05: a linear-domain kernel overflows
    assert torch.isinf(torch.exp(scores)).any()
    res = sinkhorn_dual(scores, max_iters=1000, tol=1e-3)
    assert res.iterations < 1000
    plan = transport_plan(scores, res.dual)
    assert torch.isfinite(plan).all() and torch.isfinite(res.dual).all()
    torch.testing.assert_close(plan.sum(0), torch.full((E,), 256 / E), rtol=1e-3, atol=0.0)


def test_stop_test_every_check_every_iterations():
    """The stop test (a host read) runs every check_every iterations: the solver stops at the first
    multiple of check_every at which a per-iteration test would already have stopped, a little more
    converged; check_every=1 is the per-iteration test."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(128, E, generator=g) * 2.0
    every = sinkhorn_dual(scores, max_iters=500, tol=1e-4, check_every=1)
    eight = sinkhorn_dual(scores, max_iters=500, tol=1e-4, check_every=8)
    n1, n8 = int(every.iterations), int(eight.iterations)
    assert n1 > 8 and every.host_reads == n1 and float(every.error) < 1e-4
    assert n8 % 8 == 0 and n1 <= n8 < n1 + 8 and eight.host_reads == n8 // 8
    assert float(eight.error) <= float(every.error)
    torch.testing.assert_close(transport_plan(scores, eight.dual).sum(0), torch.full((E,), 128 / E), rtol=1e-4, atol=0.0)
    capped = sinkhorn_dual(scores, max_iters=8, tol=1e-12, check_every=8)  # max_iters ends the loop without a read
    assert int(capped.iterations) == 8 and capped.host_reads == 0
    empty = sinkhorn_dual(scores, max_iters=500, row_weight=torch.zeros(128), check_every=8)  # nothing to transport
    assert int(empty.iterations) == 0 and float(empty.error) == 0.0 and torch.equal(empty.dual, torch.zeros(E))
    with pytest.raises(ValueError, match="check_every must be >= 1"):
        sinkhorn_dual(scores, check_every=0)


def test_validation_messages():
    with pytest.raises(ValueError, match="router_options.check_every"):
        build_router("ssr", 16, E, 2, check_every=0)
    with pytest.raises(ValueError, match="router_options.cost"):
        build_router("ssr", 16, E, 2, cost="quadratic")
    with pytest.raises(ValueError, match="router_options.scope"):
        build_router("ssr", 16, E, 2, scope="world")
    with pytest.raises(ValueError, match="router_options.p "):
        build_router("ssr", 16, E, 2, p=2.0)
    with pytest.raises(ValueError, match="unknown key"):
        build_router("ssr", 16, E, 2, epsilon=0.1)


def test_coin_is_shared_and_has_rate_p():
    router = build_router("ssr", 16, E, 2, p=0.01)
    flips = [router.uses_sinkhorn(RoutingContext(step=s, micro_step=m, layer_idx=l, seed=3))
             for s in range(2000) for m in range(2) for l in range(3)]
    rate = sum(flips) / len(flips)
    assert 0.006 < rate < 0.014, rate
    again = [router.uses_sinkhorn(RoutingContext(step=s, micro_step=m, layer_idx=l, seed=3))
             for s in range(2000) for m in range(2) for l in range(3)]
    assert flips == again  # a function of the context only (recomputation draws the same coin)
    other_seed = [router.uses_sinkhorn(RoutingContext(step=s, micro_step=m, layer_idx=l, seed=4))
                  for s in range(2000) for m in range(2) for l in range(3)]
    assert flips != other_seed


def _layer(router, **opts):
    torch.manual_seed(0)
    return MoELayer(16, MoEArgs(d_ff=32, num_experts=E, top_k=2, router=router,
                                router_options=dict(init_std=0.3, **opts), expert_kernel="loop", **NO_AUX))


def test_gradients_and_inference():
    x = torch.randn(64, 16)
    # Sinkhorn call of ssr: the plan is a constant, so the router gets no gradient; experts do
    layer = _layer("ssr", p=1.0)
    layer(x).sum().backward()
    assert layer.router.weight.grad is None or not layer.router.weight.grad.any()
    assert layer.experts.w1.grad.abs().sum() > 0
    assert float(layer.stats.extras["sinkhorn_calls"]) == 1.0 and float(layer.stats.extras["sinkhorn_iters"]) >= 1
    assert not layer.last_routing.gates.requires_grad
    # the baseline selects by the plan but gates by the softmax: the router trains
    base = _layer("sinkhorn")
    base(x).sum().backward()
    assert base.router.weight.grad.abs().sum() > 0
    # softmax branch (p=0) equals topk with the same weights; inference is topk whatever p
    topk = _layer("topk")
    for p in (0.0, 1.0):
        ssr = _layer("ssr", p=p)
        ssr.router.weight.data.copy_(topk.router.weight.data)
        if p == 0.0:
            torch.testing.assert_close(ssr(x), topk(x))
            assert float(ssr.stats.extras["sinkhorn_calls"]) == 0.0
        ssr.eval(), topk.eval()
        torch.testing.assert_close(ssr(x), topk(x))
        topk.train()


def test_counters_skip_recomputation():
    from torch.utils.checkpoint import checkpoint
    layer = _layer("ssr", p=1.0)
    x = torch.randn(32, 16, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert int(layer.router.sinkhorn_calls_total) == 1
    assert int(layer.router.sinkhorn_iters_total) == int(layer.stats.extras["sinkhorn_iters"])
    assert isinstance(layer.router, SelectiveSinkhornRouter)
    assert layer.router.extra_metrics()["sinkhorn_calls_total"] == 1
