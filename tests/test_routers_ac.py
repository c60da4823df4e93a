"""Adaptive Clustering routing (ac): distributed exactness of the cluster weights and the
running statistics (1 process vs 2 and 4 gloo ranks), local statistics differ, the weights'
definition (dispersion, clamp, normalisation, small clusters), eval modes, recomputation."""
import pytest
import torch
import torch.nn.functional as F

from helpers.dist_harness import run_ranks
from helpers.router_cases import SPAWN, build_jobs, call_labels, check_calls, differs, per_job, reference_calls, run_layouts
from moe_dist.moe import MoEArgs, MoELayer
from moe_dist.moe.routers import build_router
from moe_dist.moe.routers.ac import cluster_dispersion, dispersion_weights
from moe_dist.moe.routing.types import RouterInputs, RoutingContext

E = 8
AC = dict(labels=True, layer_idx=2)
CASES = {
    "ac-mad-batch": (dict(router="ac"), [dict(AC, step=0), dict(AC, step=1), dict(AC, train=False)]),
    "ac-var-running": (dict(router="ac", router_options=dict(dispersion="var", eval_mode="running", base="linear",
                                                              weight_norm="global", clamp=1.5, momentum=0.5, init_std=0.3)),
                       [dict(AC, step=0), dict(AC, step=1), dict(AC, train=False)]),
    "ac-plain-before-start-or-without-labels": (dict(router="ac"), [dict(labels=True, layer_idx=1), dict(layer_idx=3)]),
    # the authors' variants: embeddings rescaled in place, a linear gate with bias before start_layer,
    # singleton clusters, empty clusters in the normalisation (the last call's labels use 4 of the
    # 8 experts, so 4 clusters are empty)
    "ac-authors": (dict(router="ac", router_options=dict(embedding_norm=1.5, plain_gate="linear", min_count=1,
                                                         empty_clusters="included")),
                   [dict(labels=True, layer_idx=1), dict(AC, step=0), dict(AC, step=1, labels=4)]),
}
LOCAL_CASE = ("ac-local", (dict(router="ac", router_options=dict(scope="local")), [dict(AC)]))


def _rank_main(rank, world):
    return run_layouts(build_jobs(), {**CASES, LOCAL_CASE[0]: LOCAL_CASE[1]})


def test_ac_distributed():
    results = run_ranks(_rank_main, SPAWN, args=(), timeout=60)
    for name, (cfg, calls) in CASES.items():
        ref = reference_calls(cfg, calls)
        for _, label, per_rank in per_job(results, lambda r, e, u: (name, r, e, u)):
            check_calls(ref, per_rank, f"{name} {label}")
    ref = reference_calls(*CASES["ac-mad-batch"])
    assert float(ref[0]["extras"]["ac_active"]) == 1 and float(ref[0]["extras"]["ac_small_clusters"]) == 1
    assert ref[0]["extras"]["ac_cluster_sizes"].sum() == 96
    assert bool(ref[1]["state"]["running_valid"][:-1].all()) and not bool(ref[1]["state"]["running_valid"][-1])
    plain = reference_calls(*CASES["ac-plain-before-start-or-without-labels"])
    assert all(float(c["extras"]["ac_active"]) == 0 for c in plain)
    name, (cfg, calls) = LOCAL_CASE
    ref = reference_calls(cfg, calls)
    for _, label, per_rank in per_job(results, lambda r, e, u: (name, r, e, u)):
        assert differs(ref, per_rank), f"{name} {label}: local statistics equal global"


# ---- single process ---------------------------------------------------------------------------

def test_dispersion_and_weights_definition():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g) * torch.linspace(0.2, 3.0, 6)
    labels = torch.randint(0, 3, (200,), generator=g)
    labels[:3] = 3  # a cluster of 3; cluster 4 is empty
    x[labels == 0, 0] *= 0.1  # cluster 0 is tight on feature 0
    for kind in ("mad", "var"):
        counts, disp = cluster_dispersion(x, labels, 5, kind)
        for k in range(5):
            xs = x[labels == k]
            assert counts[k] == xs.shape[0]
            if xs.shape[0]:
                dev = xs - xs.mean(0)
                expect = dev.abs().mean(0) if kind == "mad" else dev.square().mean(0)
                torch.testing.assert_close(disp[k], expect, rtol=1e-5, atol=1e-6)
    counts, disp = cluster_dispersion(x, labels, 5, "mad")
    valid = counts >= 4  # cluster 3 (3 tokens) and 4 (empty) are too small
    w = dispersion_weights(disp, valid, eps=1e-4, clamp=None, norm="feature")
    torch.testing.assert_close(w[valid].mean(0), torch.ones(6))
    assert torch.equal(w[~valid], torch.ones(2, 6))
    raw = 1 / (disp[valid] + 1e-4)
    torch.testing.assert_close(w[valid], raw / raw.mean(0))  # weight ~ 1 / dispersion
    assert w[0, 0] > 3 * w[1, 0] and w[0, 0] > 3 * w[2, 0]  # a cluster's tight feature weighs more
    wg = dispersion_weights(disp, valid, eps=1e-4, clamp=1.5, norm="global")
    capped = torch.minimum(raw, 1.5 * raw.mean())
    torch.testing.assert_close(wg[valid], capped / capped.mean())
    assert (raw > 1.5 * raw.mean()).any()  # the cap was binding
    assert torch.equal(dispersion_weights(disp, torch.zeros(5, dtype=torch.bool)), torch.ones(5, 6))
    # padding rows (weight 0) are left out of every statistic
    weights = (torch.arange(200) % 4 != 0).float()
    counts_p, disp_p = cluster_dispersion(x, labels, 5, "mad", row_weight=weights)
    keep = weights.bool()
    counts_k, disp_k = cluster_dispersion(x[keep], labels[keep], 5, "mad")
    torch.testing.assert_close(counts_p, counts_k)
    torch.testing.assert_close(disp_p, disp_k)


def _layer(**opts):
    torch.manual_seed(0)
    return MoELayer(16, MoEArgs(d_ff=32, num_experts=E, top_k=2, router="ac", router_options=opts,
                                expert_kernel="loop"))


def test_scaled_scores_and_plain_fallback():
    layer = _layer(start_layer=1)
    router = layer.router
    x = torch.randn(96, 16)
    labels = call_labels(0, 96, E)
    emb = F.normalize(router.weight.detach(), dim=-1)
    plain = router(x, RoutingContext(layer_idx=0), RouterInputs(prev_top1=labels))
    torch.testing.assert_close(plain.logits, x @ emb.t())
    assert torch.equal(router(x, RoutingContext(layer_idx=3)).expert_ids, plain.expert_ids)
    ac = router(x, RoutingContext(layer_idx=1), RouterInputs(prev_top1=labels))
    w = router.last_weights
    torch.testing.assert_close(ac.logits, (x * w[labels]) @ emb.t())
    assert not torch.equal(ac.expert_ids, plain.expert_ids)
    assert torch.equal(ac.expert_ids[:, 0], ac.logits.argmax(-1))  # column 0 is the label for the next layer
    with pytest.raises(ValueError, match="prev_top1 has 5 labels for 96 tokens"):
        router(x, RoutingContext(layer_idx=1), RouterInputs(prev_top1=labels[:5]))


def test_running_statistics_and_eval_modes():
    from torch.utils.checkpoint import checkpoint
    plain, ckpt = _layer(start_layer=0, eval_mode="running", momentum=0.25), _layer(start_layer=0, eval_mode="running", momentum=0.25)
    batches = [(torch.randn(96, 16), call_labels(i, 96, E)) for i in range(3)]
    disps = []
    for x, labels in batches:
        inputs = RouterInputs(prev_top1=labels)
        plain(x, inputs).sum().backward()
        checkpoint(ckpt, x.clone().requires_grad_(), inputs, use_reentrant=False).sum().backward()  # recomputes the forward
        disps.append(cluster_dispersion(x, labels, E, "mad")[1])
    # EMA: first sighting copies, then blends; recomputation does not update again
    expect = disps[0]
    for d in disps[1:]:
        expect = 0.75 * expect + 0.25 * d
    valid = plain.router.running_valid
    assert torch.equal(valid, torch.tensor([True] * (E - 1) + [False]))
    torch.testing.assert_close(plain.router.running_dispersion[valid], expect[valid])
    torch.testing.assert_close(ckpt.router.running_dispersion, plain.router.running_dispersion)
    assert "router.running_dispersion" in plain.state_dict()
    # running mode decodes one token at a time with the training statistics
    plain.eval()
    one = torch.randn(1, 16)
    routing = plain.router(one, plain.context, RouterInputs(prev_top1=torch.tensor([2])))
    w = dispersion_weights(plain.router.running_dispersion, valid)
    emb = F.normalize(plain.router.weight.detach(), dim=-1)
    torch.testing.assert_close(routing.logits, (one * w[2]) @ emb.t())
    # batch mode on one token: every cluster is too small -> plain scores
    batch = build_router("ac", 16, E, 2, start_layer=0)
    batch.load_state_dict(plain.router.state_dict())
    batch.eval()
    torch.testing.assert_close(batch(one, plain.context).logits, one @ emb.t())


def _twins(**opts):
    """The default router and one with ``opts``, holding the same tensors."""
    torch.manual_seed(0)
    default = build_router("ac", 16, E, 2, start_layer=1)
    variant = build_router("ac", 16, E, 2, start_layer=1, **opts)
    variant.load_state_dict(default.state_dict(), strict=False)
    return default, variant


def test_embedding_rescale_same_scores_scaled_gradient():
    """embedding_norm: the scores equal the default's; the embeddings' gradient is the default's
    times |e| / 1.5 (0.32 / 1.5 at the orthogonal init, gain 0.32), and they keep norm 1.5."""
    default, rescaled = _twins(embedding_norm=1.5)
    x = torch.randn(96, 16)
    inputs = RouterInputs(prev_top1=call_labels(0, 96, E))
    norms = default.weight.detach().norm(dim=-1)
    torch.testing.assert_close(norms, torch.full((E,), 0.32))
    upstream = torch.randn(96, E)
    grads = []
    for router in (default, rescaled):
        routing = router(x, RoutingContext(layer_idx=1), inputs)
        (routing.logits * upstream).sum().backward()
        grads.append((routing.logits.detach(), routing.expert_ids, router.weight.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    assert torch.equal(grads[1][1], grads[0][1])
    torch.testing.assert_close(rescaled.weight.detach().norm(dim=-1), torch.full((E,), 1.5))
    torch.testing.assert_close(grads[1][2], grads[0][2] * (norms / 1.5)[:, None])
    assert grads[1][2].norm() < 0.25 * grads[0][2].norm()
    with pytest.raises(ValueError, match="embedding_norm"):
        build_router("ac", 16, E, 2, base="linear", embedding_norm=1.5)


def test_plain_gate_linear_with_bias():
    """plain_gate: linear scores the calls that do not cluster by x P^T + b with a gate of its own
    (plain_weight P, plain_bias b, both trained); the clustered calls equal the default's, score
    against the embeddings only and leave the plain gate without gradient."""
    default, linear = _twins(plain_gate="linear")
    x = torch.randn(96, 16)
    plain = linear(x, RoutingContext(layer_idx=0))
    torch.testing.assert_close(plain.logits, x @ linear.plain_weight.detach().t() + linear.plain_bias.detach())
    plain.gates.sum().backward()
    for name in ("plain_weight", "plain_bias"):
        grad = getattr(linear, name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert linear.weight.grad is None  # the embeddings do not score plain calls
    assert not torch.allclose(plain.logits, default(x, RoutingContext(layer_idx=0)).logits)
    linear.zero_grad(set_to_none=True)
    inputs = RouterInputs(prev_top1=call_labels(0, 96, E))
    clustered = linear(x, RoutingContext(layer_idx=1), inputs)
    torch.testing.assert_close(clustered.logits, default(x, RoutingContext(layer_idx=1), inputs).logits)
    (clustered.logits * torch.randn(96, E)).sum().backward()
    assert linear.plain_weight.grad is None and linear.plain_bias.grad is None
    assert linear.weight.grad is not None
    assert not {"plain_weight", "plain_bias"} & set(default.state_dict())
    assert {"weight", "plain_weight", "plain_bias"} <= set(linear.state_dict())


def _authors_plain_twins(seed: int, **opts):
    """The authors' plain gate and an ac router (plain_gate: linear, ``opts``) built from one seed."""
    from helpers.ac_authors_reference import AuthorsPlainGate

    torch.manual_seed(seed)
    ref = AuthorsPlainGate(16, E, 2)
    torch.manual_seed(seed)
    router = build_router("ac", 16, E, 2, start_layer=1, plain_gate="linear", **opts)
    return ref, router


def test_plain_gate_linear_is_the_authors_plain_gate_over_adamw_steps():
    """Before start_layer, plain_gate: linear with embedding_norm set is the authors' plain gate:
    the same draw under one seed (nn.Linear's default init: rows of norm about 1/sqrt(3), and a
    nonzero bias), the same logits, experts and gates, and after each AdamW step (and the
    router's after-step hook, which rescales the embeddings) the same weight and bias: nothing
    renormalises the plain gate."""
    from helpers.ac_authors_reference import dense_gates

    ref, router = _authors_plain_twins(3, embedding_norm=1.5, min_count=1, empty_clusters="included")
    assert torch.equal(router.plain_weight.detach(), ref.gate.weight.detach())
    assert torch.equal(router.plain_bias.detach(), ref.gate.bias.detach())
    assert router.plain_bias.detach().abs().min() > 0
    norms = router.plain_weight.detach().norm(dim=-1)
    torch.testing.assert_close(norms, torch.full((E,), 3 ** -0.5), atol=0.2, rtol=0)
    ctx = RoutingContext(layer_idx=0)
    opts = dict(lr=0.05, betas=(0.9, 0.95), weight_decay=0.1)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), **opts), torch.optim.AdamW(router.parameters(), **opts)
    g = torch.Generator().manual_seed(11)
    for step in range(4):
        x = torch.randn(96, 16, generator=g)
        upstream = torch.randn(96, E, generator=g)
        logits_ref, ids_ref, gates_ref = ref(x)
        routing = router(x, ctx)
        torch.testing.assert_close(routing.logits, logits_ref, rtol=1e-6, atol=1e-6, msg=lambda m: f"step {step}: {m}")
        dense_ref, dense = dense_gates(ids_ref, gates_ref, E), dense_gates(routing.expert_ids, routing.gates, E)
        assert torch.equal(dense > 0, dense_ref > 0), f"step {step}: experts differ"
        torch.testing.assert_close(dense, dense_ref, rtol=1e-6, atol=1e-6)
        for d, o in ((dense_ref, opt_ref), (dense, opt)):
            o.zero_grad(set_to_none=True)
            (d * upstream).sum().backward()
            o.step()
        router.after_optimizer_step(ctx)
        torch.testing.assert_close(router.plain_weight.detach(), ref.gate.weight.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(router.plain_bias.detach(), ref.gate.bias.detach(), rtol=1e-6, atol=1e-6)
    moved = router.plain_weight.detach().norm(dim=-1)
    assert not torch.allclose(moved, norms) and not torch.allclose(moved, torch.full((E,), 1.5), atol=0.1)


def test_embedding_rescale_touches_only_the_clustered_scores():
    """embedding_norm with plain_gate: linear: after an optimizer step of a plain layer (before
    start_layer) and of a clustered layer, the clustered layer's embeddings are back at norm
    1.5, the plain layer's gate is what AdamW made of it (not rescaled), and neither layer's
    unused tensors move."""
    layers = []
    for idx in (0, 1):  # start_layer 1: block 0 plain, block 1 clustered
        layer = _layer(start_layer=1, embedding_norm=1.5, plain_gate="linear")
        layer.context.layer_idx = idx
        layers.append(layer)
    before = [{k: v.detach().clone() for k, v in layer.router.named_parameters()} for layer in layers]
    opts = [torch.optim.AdamW(layer.parameters(), lr=0.05, weight_decay=0.1) for layer in layers]
    x = torch.randn(96, 16)
    inputs = RouterInputs(prev_top1=call_labels(0, 96, E))
    for layer, opt in zip(layers, opts):
        opt.zero_grad(set_to_none=True)
        (layer(x, inputs) * torch.randn(96, 16)).sum().backward()
        opt.step()
    # the plain gate just after the step: a plain rescale would have to reach it by the hook below
    stepped = layers[0].router.plain_weight.detach().clone()
    for layer in layers:
        layer.after_optimizer_step()
    plain, clustered = (layer.router for layer in layers)
    assert float(layers[0].stats.extras["ac_active"]) == 0 and float(layers[1].stats.extras["ac_active"]) == 1
    assert torch.equal(plain.plain_weight.detach(), stepped)
    assert not torch.equal(stepped, before[0]["plain_weight"])
    assert not torch.allclose(stepped.norm(dim=-1), torch.full((E,), 1.5), atol=0.1)
    torch.testing.assert_close(clustered.weight.detach().norm(dim=-1), torch.full((E,), 1.5))
    assert not torch.equal(clustered.weight.detach(), before[1]["weight"])
    # unused tensors: no gradient, so AdamW leaves them; the plain layer's embeddings, already at
    # norm 1.5, are rescaled to it again (equal up to rounding)
    assert torch.equal(clustered.plain_weight.detach(), before[1]["plain_weight"])
    assert torch.equal(clustered.plain_bias.detach(), before[1]["plain_bias"])
    torch.testing.assert_close(plain.weight.detach(), before[0]["weight"])


def test_empty_and_singleton_clusters_as_the_authors_code():
    """empty_clusters: included puts clusters without tokens (dispersion 0, weight 1/eps) into the
    clamp and the per-feature means; without empty clusters it changes nothing. min_count: 1
    keeps a one-token cluster (dispersion 0: its weights hit the clamp)."""
    x = torch.randn(96, 16)
    default, included = _twins(empty_clusters="included", min_count=1)
    _, singletons = _twins(min_count=1)
    full = RouterInputs(prev_top1=call_labels(0, 96, E))  # every expert a cluster, the last of one token
    singletons(x, RoutingContext(layer_idx=1), full)
    included(x, RoutingContext(layer_idx=1), full)
    torch.testing.assert_close(included.last_weights, singletons.last_weights)  # no cluster empty
    default(x, RoutingContext(layer_idx=1), full)
    assert torch.equal(default.last_weights[E - 1], torch.ones(16))  # default: a singleton gets weight 1
    counts, disp = cluster_dispersion(x, full.prev_top1, E, "mad")
    assert disp[E - 1].abs().max() == 0
    expect = dispersion_weights(disp, counts >= 1)
    torch.testing.assert_close(singletons.last_weights, expect)
    half = RouterInputs(prev_top1=call_labels(0, 96, 4))  # experts 4..7 have no token
    counts, disp = cluster_dispersion(x, half.prev_top1, E, "mad")
    included(x, RoutingContext(layer_idx=1), half)
    torch.testing.assert_close(included.last_weights, dispersion_weights(disp, (counts >= 1) | (counts == 0)))
    singletons(x, RoutingContext(layer_idx=1), half)
    used = slice(0, 4)
    assert not torch.allclose(included.last_weights[used], singletons.last_weights[used])


def test_validation_messages():
    for key, value in (("dispersion", "std"), ("weight_norm", "expert"), ("scope", "world"), ("eval_mode", "ema"),
                       ("base", "cosine"), ("plain_gate", "bias"), ("empty_clusters", "drop")):
        with pytest.raises(ValueError, match=f"router_options.{key}"):
            build_router("ac", 16, E, 2, **{key: value})
    with pytest.raises(ValueError, match="min_count"):
        build_router("ac", 16, E, 2, min_count=0)


# ---- the trainer: embedding_norm under FSDP2 --------------------------------------------------
AUTHORS = ["model.moe.router=ac", "model.moe.num_experts=8", "model.moe.router_options.start_layer=1",
           "model.moe.router_options.embedding_norm=1.5", "model.moe.router_options.plain_gate=linear",
           "model.moe.router_options.min_count=1", "model.moe.router_options.empty_clusters=included"]


def _ac_run(tmp: str, name: str, *extra) -> dict:
    import os

    from moe_dist.config import load_config
    from moe_dist.distributed.shards import local_rows
    from moe_dist.train.loop.trainer import Trainer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs/test.yaml"), [
        f"run.dir={tmp}/{name}", f"data.cache_dir={tmp}/cache", f"data.corpus={root}/tests/data/python-docs",
        "run.tensorboard=false", "run.plots=false", "ckpt.save_final=false", "train.steps=4", *AUTHORS, *extra])
    trainer = Trainer(cfg)
    try:
        losses = [trainer.train_step()["loss"] for _ in range(cfg.train.steps)]
        norms = [local_rows(layer.router.weight).local.detach().float().norm(dim=-1) for layer in trainer.moe]
        return {"loss": losses, "norms": norms}
    finally:
        trainer.close()


def _ac_ranks(rank, world, tmp):
    return {ep: _ac_run(tmp, f"r{world}-ep{ep}", f"parallel.ep={ep}") for ep in (1, 2)}


@pytest.mark.slow
def test_embedding_norm_trains_alike_on_one_process_and_fsdp_ranks(tmp_path):
    """The rescale reaches FSDP2's shards (it runs after the optimizer step, on the rows a rank
    holds), so 2 ranks (FSDP2 over 2, and ep=2) train as 1 process and every embedding keeps norm
    1.5. A rescale inside the forward changed only FSDP2's gathered copy: the shards kept their
    norm and the backward's second gather mixed the two."""
    tmp = str(tmp_path)
    ref = _ac_run(tmp, "one", "parallel.ep=1")
    for res in run_ranks(_ac_ranks, 2, args=(tmp,), timeout=300):
        for ep, got in res.items():
            torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(ref["loss"]), rtol=1e-5, atol=0,
                                       msg=lambda m: f"ep={ep}: {m}")
            for n in got["norms"]:
                if n.numel():
                    torch.testing.assert_close(n, torch.full_like(n, 1.5))
    for n in ref["norms"]:
        torch.testing.assert_close(n, torch.full_like(n, 1.5))
