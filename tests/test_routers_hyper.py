"""HyperRouter (hyper) and SMoE-Dropout (smoe_dropout): distributed exactness over the k
schedule (1 process vs 2 and 4 gloo ranks), frozen parts identical on every rank (broadcast +
hash check, negative control without it), outside the optimizer, and the inference cache."""
import pytest
import torch

from helpers.dist_harness import run_ranks
from helpers.router_cases import SPAWN, build_jobs, check_calls, differs, distributed_calls, per_job, reference_calls, run_layouts
from moe_dist.moe import MoEArgs, MoELayer
from moe_dist.moe.routers import build_router, synchronize_frozen_routers
from moe_dist.moe.routers import set_inference_k
from moe_dist.moe.routers.hyper import FrozenRouter, HyperRouter, scheduled_k
from moe_dist.moe.routing.types import RoutingContext

E = 8
HYPER = dict(router="hyper", router_options=dict(embed_dim=16, hyper_dim=32, k_max=6, k_schedule_steps=10))
CASES = {
    # k = 2, 4, 6, 6 over the schedule; eval at k_max, then at eval_k = 3
    "hyper-schedule": (HYPER, [dict(step=0), dict(step=5), dict(step=10), dict(step=25),
                               dict(train=False, step=5), dict(train=False, eval_k=3)]),
    "smoe-dropout": (dict(router="smoe_dropout", top_k=1, router_options=dict(k_max=4, k_schedule_steps=8, init_std=0.3)),
                     [dict(step=0), dict(step=3), dict(step=8), dict(train=False, eval_k=2)]),
}
FROZEN_CASE = (HYPER, [dict(step=0), dict(step=5)])


def _perturb_unless_rank0(layer, rank):
    if rank:
        for t in layer.router.frozen_tensors():
            t.add_(0.01 * rank)


def _frozen_checks(job):
    """Broadcast, hash check and its negative control on one job's group."""
    cfg, calls = FROZEN_CASE

    def perturb_then_sync(layer, rank):
        _perturb_unless_rank0(layer, rank)
        assert synchronize_frozen_routers(layer, job.group) == 1

    out = {"synced": distributed_calls(job.rank, job.ranks, cfg, calls, job.groups, True, prepare=perturb_then_sync),
           "unsynced": distributed_calls(job.rank, job.ranks, cfg, calls, job.groups, True, prepare=_perturb_unless_rank0)}
    # after init every rank holds the same frozen tensors; a divergent rank is caught on every rank
    torch.manual_seed(5)
    router = build_router("hyper", 16, E, 2, embed_dim=16, hyper_dim=32)
    router.verify_frozen(job.group)
    out["digest"] = router.frozen_digest()
    if job.rank == job.ranks - 1:
        router.hyper_w2[0, 0] += 1.0
    try:
        router.verify_frozen(job.group, name="layers.0.moe.router")
        out["verify_error"] = None
    except RuntimeError as err:
        out["verify_error"] = str(err)
    router.synchronize_frozen(job.group)
    out["digest_after_sync"] = router.frozen_digest()
    return out


def _rank_main(rank, world):
    jobs = build_jobs()
    results = run_layouts(jobs, CASES)
    for (ranks, ep), job in jobs.items():
        if ranks == ep:
            results[("frozen", ranks)] = _frozen_checks(job)
    return results


def test_hyper_distributed():
    results = run_ranks(_rank_main, SPAWN, args=(), timeout=60)
    for name, (cfg, calls) in CASES.items():
        ref = reference_calls(cfg, calls)
        for _, label, per_rank in per_job(results, lambda r, e, u: (name, r, e, u)):
            check_calls(ref, per_rank, f"{name} {label}")
    assert [c["k"] for c in reference_calls(*CASES["hyper-schedule"])] == [2, 4, 6, 6, 6, 3]
    assert [c["k"] for c in reference_calls(*CASES["smoe-dropout"])] == [1, 2, 4, 2]
    ref = reference_calls(*FROZEN_CASE)
    for ranks in (4, 2):
        for start in range(0, SPAWN, ranks):
            job = [r[("frozen", ranks)] for r in results[start : start + ranks]]
            check_calls(ref, [r["synced"] for r in job], f"frozen tensors broadcast from the first rank ({ranks} ranks)")
            assert differs(ref, [r["unsynced"] for r in job]), "perturbed frozen tensors should change the outputs"
            assert len({r["digest"] for r in job}) == 1
            for r in job:  # every rank raises, so no rank is left waiting in a collective
                assert r["verify_error"] is not None and "differ between ranks" in r["verify_error"]
                assert f"[{ranks - 1}]" in r["verify_error"] and "layers.0.moe.router" in r["verify_error"]
                assert r["digest_after_sync"] == job[0]["digest"]


# ---- single process ---------------------------------------------------------------------------

def test_k_schedule():
    assert [scheduled_k(t, 2, 16, 100) for t in (0, 1, 3, 50, 99, 100, 500)] == [2, 2, 2, 9, 16, 16, 16]
    assert scheduled_k(-5, 8, 16, 10) == 8 and scheduled_k(7, 4, 4, None) == 4
    router = build_router("hyper", 16, E, 2, k_max=E, k_schedule_steps=12, embed_dim=8, hyper_dim=8)
    x = torch.randn(10, 16)
    for step, k in ((0, 2), (6, 5), (12, 8), (40, 8)):
        routing = router(x, RoutingContext(step=step))
        assert routing.expert_ids.shape == (10, k) and float(routing.extras["k"]) == k
        assert all(len(set(row.tolist())) == k for row in routing.expert_ids)
    router.eval()
    assert router(x, RoutingContext(step=6)).top_k == E  # eval default: k_max
    wrapper = torch.nn.Sequential(router)
    assert set_inference_k(wrapper, 1) == 1 and router(x, RoutingContext(step=6)).top_k == 1
    set_inference_k(wrapper, None)
    assert router(x, RoutingContext(step=0)).top_k == E


def test_validation_messages():
    with pytest.raises(ValueError, match="k_schedule_steps"):
        build_router("hyper", 16, E, 2, k_max=4)
    with pytest.raises(ValueError, match="k_min <= k_max"):
        build_router("smoe_dropout", 16, E, 2, k_min=4, k_max=3, k_schedule_steps=5)
    with pytest.raises(ValueError, match="k_max <= num_experts"):
        build_router("smoe_dropout", 16, E, 2, k_max=9, k_schedule_steps=5)
    with pytest.raises(ValueError, match="eval_k"):
        build_router("hyper", 16, E, 2, eval_k=0)


def test_frozen_parts_outside_the_optimizer():
    torch.manual_seed(0)
    layer = MoELayer(16, MoEArgs(d_ff=32, num_experts=E, top_k=2, router="hyper",
                                 router_options=dict(embed_dim=8, hyper_dim=16), expert_kernel="loop"))
    frozen = {id(t) for t in layer.router.frozen_tensors()}
    names = dict(layer.named_parameters())
    assert "router.embedding" in names and not any("hyper_w" in n for n in names)
    from types import SimpleNamespace

    from moe_dist.train.loop.optim import build_optimizer  # the trainer's rule: requires_grad parameters only

    opt = build_optimizer(layer, SimpleNamespace(lr=0.1, weight_decay=0.1, beta1=0.9, beta2=0.95))
    in_opt = {id(p) for group in opt.param_groups for p in group["params"]}
    assert not frozen & in_opt and id(layer.router.embedding) in in_opt
    before = [t.clone() for t in layer.router.frozen_tensors()]
    emb = layer.router.embedding.detach().clone()
    layer(torch.randn(20, 16)).pow(2).sum().backward()
    assert all(t.grad is None for t in layer.router.frozen_tensors())
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, layer.router.frozen_tensors()))
    assert not torch.equal(emb, layer.router.embedding)
    assert {"router.hyper_w1", "router.hyper_w2"} <= set(layer.state_dict())
    # smoe_dropout: nothing of the router trains
    dropout = MoELayer(16, MoEArgs(d_ff=32, num_experts=E, top_k=2, router="smoe_dropout", expert_kernel="loop"))
    assert not list(dropout.router.parameters()) and "router.frozen_weight" in dropout.state_dict()


def test_inference_cache_matches_training_router():
    torch.manual_seed(1)
    router = build_router("hyper", 16, E, 2, embed_dim=8, hyper_dim=16)
    assert isinstance(router, HyperRouter) and isinstance(router, FrozenRouter)
    x = torch.randn(12, 16)
    ctx = RoutingContext()
    w_train, b_train = router.router_weights()
    train_routing = router(x, ctx)
    router.eval()
    w_eval, b_eval = router.router_weights()
    torch.testing.assert_close(w_eval, w_train.detach(), rtol=0, atol=0)
    torch.testing.assert_close(b_eval, b_train.detach(), rtol=0, atol=0)
    assert router.router_weights()[0] is w_eval  # generated once, then cached
    eval_routing = router(x, ctx)
    assert torch.equal(eval_routing.expert_ids, train_routing.expert_ids)
    torch.testing.assert_close(eval_routing.gates, train_routing.gates.detach())
    with torch.no_grad():  # a changed embedding (optimizer step, checkpoint load) invalidates the cache
        router.embedding.add_(1.0)
    w_new = router.router_weights()[0]
    assert not torch.equal(w_new, w_eval)
    with torch.no_grad():  # so does an in-place change of the frozen part
        router.hyper_w2.mul_(2.0)
    torch.testing.assert_close(router.router_weights()[0], 2.0 * w_new)
    # a loaded state reproduces the router exactly
    other = build_router("hyper", 16, E, 2, embed_dim=8, hyper_dim=16).eval()
    other.load_state_dict(router.state_dict())
    torch.testing.assert_close(other.router_weights()[0], router.router_weights()[0], rtol=0, atol=0)


@pytest.mark.parametrize("router", ["hyper", "smoe_dropout"])
def test_active_parameters_count_the_k_training_ends_with(router):
    """A k schedule from 2 to 6 ends with 6 experts per token: the model's and the planner's
    counts of active parameters use that k, not top_k."""
    from moe_dist.config import config_from_dict
    from moe_dist.model import build_model, count_parameters
    from moe_dist.model.params import count_params

    def config(options):
        return config_from_dict({"model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "d_ff": 64,
                                           "moe": {"num_experts": E, "top_k": 2, "d_ff": 16, "router": router,
                                                   "router_options": options}},
                                 "train": {"steps": 10}})

    ramp, fixed = config({"k_max": 6}), config({})
    per_expert = 3 * 32 * 16
    for cfg, k in ((ramp, 6), (fixed, 2)):
        counts, want = count_params(cfg.model), count_parameters(build_model(cfg.model, 64, device="meta"))
        assert (counts["total"], counts["active"]) == (want["total"], want["active"])
        assert counts["active"] == counts["total"] - 2 * (E - k) * per_expert
