"""Shared experts, fine-grained experts, the aux-loss-free expert bias, the sequence-level
balance loss and router_dtype: a loop reference for the layer (outputs and gradients), and
R ranks training a layer for several steps computing what one process computes (expert
bias, losses, weights), with a ``local`` control that differs where a statistic couples ranks."""
import math

import pytest
import torch
import torch.nn.functional as F

from helpers.dist_harness import run_ranks
from moe_dist.config import ConfigError, load_config
from moe_dist.distributed import build_parallel_groups
from moe_dist.moe import MoEArgs, MoELayer
from moe_dist.parallel import apply_expert_parallel, sync_gradients

D, E = 16, 8
B, S = 6, 8  # sequences per step and their length


def make(cfg: dict, seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    cfg = dict(cfg)
    return MoELayer(D, MoEArgs(d_ff=cfg.pop("d_ff", 8), num_experts=cfg.pop("num_experts", E),
                               top_k=cfg.pop("top_k", 2), expert_kernel="loop", **cfg))


# ---- loop reference ------------------------------------------------------------------------
def loop_reference(p: dict, x: torch.Tensor, bias: torch.Tensor, k: int, aux_coef: float, z_coef: float):
    """Token by token, expert by expert, from the definitions: softmax router, choice by
    probs + bias, gates the chosen probs renormalised, SwiGLU experts, gated SwiGLU shared
    expert; DeepSeek's sequence-wise balance loss averaged over sequences, router z-loss."""
    Bq, Sq, _ = x.shape
    x2 = x.reshape(-1, D)
    logits = x2 @ p["router.weight"].t()
    probs = torch.softmax(logits, -1)
    out = []
    chosen = []
    for t in range(x2.shape[0]):
        ids = torch.topk(probs[t].detach() + bias, k).indices
        chosen.append(ids)
        g = probs[t][ids] / probs[t][ids].sum()
        y = torch.zeros(D)
        for j, e in enumerate(ids.tolist()):
            h = F.silu(x2[t] @ p["experts.w1"][e]) * (x2[t] @ p["experts.w3"][e])
            y = y + g[j] * (h @ p["experts.w2"][e])
        sh = (F.silu(p["shared_expert.w1.weight"] @ x2[t]) * (p["shared_expert.w3.weight"] @ x2[t]))
        sh = p["shared_expert.w2.weight"] @ sh
        y = y + torch.sigmoid(p["shared_expert_gate.weight"] @ x2[t]) * sh
        out.append(y)
    seq_losses = []
    for b in range(Bq):
        rows = range(b * Sq, (b + 1) * Sq)
        f = torch.zeros(E)
        for t in rows:
            for e in chosen[t].tolist():
                f[e] += E / (k * Sq)
        P = probs[b * Sq:(b + 1) * Sq].mean(0)
        seq_losses.append((f * P).sum())
    seq_loss = torch.stack(seq_losses).mean()
    z = torch.logsumexp(logits, -1).square().mean()
    return torch.stack(out).view(Bq, Sq, D), aux_coef * seq_loss + z_coef * z, seq_loss


def test_shared_fine_grained_layer_matches_a_loop_reference():
    # fine-grained: expert hidden 8 (the dense FFN of a d_model=16 model would be larger); E=8, k=3
    layer = make(dict(top_k=3, shared_d_ff=12, shared_gate=True, expert_bias=True, balance_loss="sequence",
                      aux_loss_coef=0.1, z_loss_coef=0.01))
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.linspace(-0.2, 0.2, E))  # large enough to change choices
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, S, D, generator=g)
    w = torch.randn(B, S, D, generator=g)
    xa = x.clone().requires_grad_(True)
    out = layer(xa)
    ((out * w).sum() / (B * S) + layer.aux_loss).backward()

    p = {n: t.detach().clone().requires_grad_(True) for n, t in layer.named_parameters()}
    xb = x.clone().requires_grad_(True)
    ref, aux, seq_loss = loop_reference(p, xb, layer.router.expert_bias, 3, 0.1, 0.01)
    ((ref * w).sum() / (B * S) + aux).backward()

    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.aux_loss, aux.to(layer.aux_loss.dtype), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(layer.stats.aux_loss.float(), seq_loss.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-6)
    for n, t in layer.named_parameters():
        torch.testing.assert_close(t.grad, p[n].grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    assert torch.count_nonzero(layer.router.expert_bias.grad if layer.router.expert_bias.grad is not None else
                               torch.zeros(1)) == 0  # a buffer: no gradient
    # the bias changed the choice for some tokens (else the test would not test it)
    probs = torch.softmax(x.reshape(-1, D) @ layer.router.weight.detach().t(), -1)
    unbiased = torch.topk(probs, 3).indices.sort(-1).values
    assert (unbiased != layer.last_routing.expert_ids.sort(-1).values).any()


def test_router_dtype_fp64_computes_scores_in_fp64():
    layer = make(dict(router_dtype="fp64"))
    layer(torch.randn(10, D))
    assert layer.last_routing.probs.dtype == torch.float64 and layer.last_routing.logits.dtype == torch.float64
    ref = make(dict())
    x = torch.randn(10, D)
    y64, y32 = layer(x), ref(x)
    torch.testing.assert_close(y64, y32, rtol=1e-5, atol=1e-6)  # same weights, same function
    assert y64.dtype == torch.float32


@pytest.mark.parametrize("kwargs,match", [
    (dict(router="ssr", expert_bias=True), "model.moe.expert_bias=true is not allowed with router 'ssr'"),
    (dict(router="symphony", expert_bias=True), "allowed routers: \\[.*'ac', 'attention', 'hyper'"),
    (dict(router="sinkhorn", router_dtype="fp64"), "model.moe.router_dtype=fp64 is not allowed with router 'sinkhorn'"),
    (dict(router_dtype="fp16"), "model.moe.router_dtype='fp16' is not allowed; allowed: \\['fp32', 'fp64'\\]"),
    (dict(balance_loss="token"), "model.moe.balance_loss='token' is not allowed; allowed: \\['batch', 'sequence'\\]"),
    (dict(shared_gate=True), "model.moe.shared_gate: true needs a shared expert"),  # the config's wording too (below)
    (dict(expert_bias=True, expert_bias_rate=-1.0), "model.moe.expert_bias_rate: -1.0 is too small; allowed: >= 0"),
    (dict(capacity_factor=0.0), "model.moe.capacity_factor: 0.0 is not allowed; allowed: > 0"),
    (dict(min_capacity=-1), "model.moe.min_capacity: -1 is too small; allowed: >= 0"),
])
def test_bad_combinations_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(kwargs)


def test_sequence_loss_needs_sequences():
    with pytest.raises(ValueError, match="balance_loss='sequence' needs \\[batch, seq, 16\\] input"):
        make(dict(balance_loss="sequence"))(torch.randn(10, D))


@pytest.mark.parametrize("override,match", [
    ("model.moe.expert_bias=true model.moe.router=ssr", "model.moe.expert_bias=true is not allowed with router 'ssr'"),
    ("model.moe.router_dtype=fp64 model.moe.router=symphony", "model.moe.router_dtype=fp64 is not allowed with router"),
    ("model.moe.shared_gate=true", "model.moe.shared_gate: true needs a shared expert"),
    ("model.moe.granularity=2", "model.moe.granularity: 2: read only by `moe-dist upcycle`"),
])
def test_config_refuses_bad_combinations(override, match):
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with pytest.raises(ConfigError, match=match):
        load_config(os.path.join(root, "configs/test.yaml"), override.split())


def test_planner_counts_shared_experts_like_the_model():
    from moe_dist.config import config_from_dict
    from moe_dist.model import build_model, count_parameters
    from moe_dist.model.params import count_params

    cfg = config_from_dict({"model": {"vocab_size": 64, "d_model": 32, "n_layers": 3, "n_heads": 4, "d_ff": 64, "moe": {
        "layers": "every_other", "num_experts": 8, "top_k": 2, "d_ff": 16, "shared_d_ff": 24, "shared_gate": True,
        "expert_bias": True}}})
    model = build_model(cfg.model, 64, device="meta")
    counts, want = count_params(cfg.model), count_parameters(model)
    assert (counts["total"], counts["active"]) == (want["total"], want["active"])
    assert counts["shared_experts"] == 3 * 32 * 24 + 32


# ---- 1 vs 2 vs 4 ranks, several steps -------------------------------------------------------
LR, STEPS = 0.5, 4
CASES = {
    # shared gated expert, fine-grained experts, sequence loss, expert bias: all reduced globally
    "global": dict(top_k=2, shared_d_ff=12, shared_gate=True, expert_bias=True, expert_bias_rate=0.05,
                   balance_loss="sequence", aux_loss_coef=0.1),
    # xmoe with fp64 scores, batch loss, expert bias, capacity
    "xmoe-fp64": dict(router="xmoe", router_dtype="fp64", expert_bias=True, expert_bias_rate=0.05,
                      capacity_factor=1.5),
    # node-limited routing (2 of 4 expert groups per token) with the sequence loss and the expert bias
    "grouped": dict(top_k=3, router_groups=4, max_groups_per_token=2, expert_bias=True, expert_bias_rate=0.05,
                    balance_loss="sequence", aux_loss_coef=0.1),
    # the control: per-rank statistics (what per-GPU code does)
    "local": dict(top_k=2, shared_d_ff=12, shared_gate=True, expert_bias=True, expert_bias_rate=0.05,
                  balance_loss="sequence", aux_loss_coef=0.1, loss_scope="local"),
}
SPLITS = {1: [6], 2: [2, 4], 4: [1, 1, 2, 2]}  # sequences per rank: uneven


def batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(B, S, D, generator=g), torch.randn(B, S, D, generator=g)


def train_layer(rank: int, world: int, cfg: dict, ep: int) -> dict:
    layer = make(cfg)
    groups = None
    if world > 1:
        groups = build_parallel_groups(ep, cfg.get("num_experts", E))
        layer = apply_expert_parallel(layer, groups)
    sizes = SPLITS[world]
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    aux, outs = [], []
    for step in range(STEPS):
        x, w = batch(step)
        out = layer(x[lo:hi])
        loss = (out * w[lo:hi]).sum() / (B * S) + layer.aux_loss
        loss.backward()
        if groups is not None:
            sync_gradients(layer, groups)
        with torch.no_grad():
            for p in layer.parameters():
                p -= LR * p.grad
                p.grad = None
        layer.after_optimizer_step()
        aux.append(float(layer.stats.aux_loss))
        outs.append(out.detach())
    spans = layer.stats.group_spans
    return {"aux": aux, "bias": layer.expert_bias.clone(), "out": outs, "offset": layer.experts.offset,
            "spans": None if spans is None else spans.clone(),
            "params": {n: p.detach().clone() for n, p in layer.named_parameters()}}


def _all(rank, world, ep):
    return {name: train_layer(rank, world, cfg, ep) for name, cfg in CASES.items()}


@pytest.fixture(scope="module")
def one_process():
    return {name: train_layer(0, 1, cfg, 1) for name, cfg in CASES.items()}


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (4, 2)])
def test_expert_bias_and_losses_do_not_depend_on_the_layout(one_process, world, ep):
    results = run_ranks(_all, world, args=(ep,))
    for name in ("global", "xmoe-fp64", "grouped"):
        ref = one_process[name]
        assert ref["bias"].abs().max() > 0  # the bias moved
        for rank, res in enumerate(results):
            got = res[name]
            assert torch.equal(got["bias"], ref["bias"]), (name, rank, got["bias"], ref["bias"])
            torch.testing.assert_close(torch.tensor(got["aux"]), torch.tensor(ref["aux"]), rtol=1e-5, atol=1e-7)
            if ref["spans"] is not None:  # tokens per number of groups reached: global, and within the limit
                assert torch.equal(got["spans"], ref["spans"]) and not ref["spans"][2:].any(), (got["spans"], ref["spans"])
            for n, p in got["params"].items():
                want = ref["params"][n]
                if n.startswith("experts."):
                    want = want[got["offset"]: got["offset"] + p.shape[0]]
                torch.testing.assert_close(p, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} {n}: {m}")
        out = [torch.cat([r[name]["out"][s] for r in results]) for s in range(STEPS)]
        for s in range(STEPS):
            torch.testing.assert_close(out[s], ref["out"][s], rtol=1e-4, atol=1e-5)
    # the local control: per-rank counts give per-rank biases and a loss that depends on the split
    ref = one_process["local"]
    torch.testing.assert_close(torch.tensor(ref["aux"]), torch.tensor(one_process["global"]["aux"]))  # 1 rank: same
    biases = [r["local"]["bias"] for r in results]
    assert any(not torch.equal(b, ref["bias"]) for b in biases)
    assert any(not torch.equal(b, biases[0]) for b in biases[1:])
    # the mean of per-rank means of the sequence loss is not the mean over sequences when ranks hold unequal numbers
    # of sequences (step 0, before any weight differs): off by far more than the global scope's rounding
    global_err = max(abs(r["global"]["aux"][0] - one_process["global"]["aux"][0]) for r in results)
    assert abs(results[0]["local"]["aux"][0] - ref["aux"][0]) > 20 * max(global_err, 1e-7)
    w_local, w_ref = results[0]["local"]["params"]["router.weight"], ref["params"]["router.weight"]
    assert (w_local - w_ref).abs().max() > 1e-4


# ---- the trainer: 1 vs 2 vs 4 ranks, and a resume at another layout -------------------------
FEATURES = ["model.moe.num_experts=8", "model.moe.expert_bias=true", "model.moe.expert_bias_rate=0.01", "model.moe.shared_d_ff=32",
            "model.moe.shared_gate=true", "model.moe.balance_loss=sequence"]


def _train_config(tmp, name, *extra):
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return load_config(os.path.join(root, "configs/test.yaml"), [
        f"run.dir={tmp}/{name}", f"data.cache_dir={tmp}/cache", f"data.corpus={root}/tests/data/python-docs",
        "run.tensorboard=false", "run.plots=false", "ckpt.save_final=false", "train.steps=5", *FEATURES, *extra])


def _curve(cfg, save: bool = False) -> dict:
    from moe_dist.train.loop.trainer import Trainer

    trainer = Trainer(cfg)
    try:
        start = trainer.step
        rows = [trainer.train_step() for _ in range(start, cfg.train.steps)]
        out = {"start": start, "loss": [r["loss"] for r in rows], "aux": [r["aux_loss"] for r in rows],
               "bias": [layer.expert_bias.clone() for layer in trainer.moe]}
        if save:
            trainer.save()
        return out
    finally:
        trainer.close()


def _trainer_ranks(rank, world, tmp, ep):
    if world == 2:
        return {"full": _curve(_train_config(tmp, "full2", f"parallel.ep={ep}")),
                "local": _curve(_train_config(tmp, "local2", f"parallel.ep={ep}", "model.moe.loss_scope=local")),
                "half": _curve(_train_config(tmp, "half2", f"parallel.ep={ep}", "train.steps=2"), save=True)}
    return {"resumed": _curve(_train_config(tmp, "resumed4", f"parallel.ep={ep}", f"resume={tmp}/half2"))}


@pytest.mark.slow
def test_trainer_bias_and_losses_match_one_process_and_survive_a_resume_at_another_layout(tmp_path):
    tmp = str(tmp_path)
    ref = _curve(_train_config(tmp, "ref1", "parallel.ep=1"))
    assert all(b.abs().max() > 0 for b in ref["bias"])  # 5 sign steps of +-rate: never back at 0
    two = run_ranks(_trainer_ranks, 2, args=(tmp, 2), timeout=300)
    four = run_ranks(_trainer_ranks, 4, args=(tmp, 2), timeout=300)  # resumes the 2-rank run at 4 ranks
    for res in two:
        torch.testing.assert_close(torch.tensor(res["full"]["loss"]), torch.tensor(ref["loss"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(res["full"]["aux"]), torch.tensor(ref["aux"]), rtol=1e-4, atol=1e-9)
        for got, want in zip(res["full"]["bias"], ref["bias"]):
            assert torch.equal(got, want), (got, want)
        # the control: each rank's own counts
        assert any(not torch.equal(got, want) for got, want in zip(res["local"]["bias"], ref["bias"]))
    assert any(not torch.equal(a, b) for a, b in zip(two[0]["local"]["bias"], two[1]["local"]["bias"]))
    for res in four:
        assert res["resumed"]["start"] == 2
        torch.testing.assert_close(torch.tensor(res["resumed"]["loss"]), torch.tensor(ref["loss"][2:]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(res["resumed"]["aux"]), torch.tensor(ref["aux"][2:]), rtol=1e-4, atol=1e-9)
        for got, want in zip(res["resumed"]["bias"], ref["bias"]):
            assert torch.equal(got, want), (got, want)


def test_new_options_add_no_host_reads():
    """Forward (the layer's one read), backward and the bias update (none) read the host no more
    often with a shared gated expert, the sequence loss, the expert bias and fp64 scores."""
    from helpers.host_sync import count_host_syncs

    layer = make(dict(shared_d_ff=12, shared_gate=True, balance_loss="sequence", expert_bias=True, router_dtype="fp64"))
    x = torch.randn(B, S, D, requires_grad=True)
    layer(x).sum().backward()  # warm-up
    with count_host_syncs() as fwd:
        out = layer(x)
    with count_host_syncs() as rest:
        (out.sum() + layer.aux_loss).backward()
        layer.after_optimizer_step()
    assert len(fwd) == 1, fwd.describe()
    assert len(rest) == 0, rest.describe()


def test_a_skipped_step_does_not_move_the_bias():
    layer = make(dict(expert_bias=True, expert_bias_rate=0.1))
    layer(torch.randn(20, D))
    layer.discard_step()  # the trainer's path for a step with a non-finite loss
    layer.after_optimizer_step()
    assert torch.count_nonzero(layer.expert_bias) == 0
    layer(torch.randn(20, D))
    layer.after_optimizer_step()
    assert torch.count_nonzero(layer.expert_bias) > 0
