"""Routing diagnostics: load figures and fluctuation rates against hand-computed cases, the
RoutingDiagnostics object on a tiny model (1 process and 2 gloo ranks), PNGs."""
import math

import pytest
import torch
import torch.nn as nn

from helpers.dist_harness import run_ranks

from moe_dist.diagnostics import (RoutingDiagnostics, fluctuation_rates, format_routing_summary, load_summary,
                                  probe_assignments, ranked_experts, routing_summary)
from moe_dist.distributed import build_parallel_groups
from moe_dist.moe import MoEArgs, MoELayer, collect_stats
from moe_dist.moe.routing.types import AttentionInputs, Routing, RouterInputs
from moe_dist.parallel import apply_expert_parallel

D, E, VOCAB = 16, 4, 40


def test_load_summary_by_hand():
    s = load_summary([3, 1, 0, 0])  # mean 1, deviations (2, 0, -1, -1): std sqrt(6/4)
    assert s["load"] == [0.75, 0.25, 0.0, 0.0]
    assert s["max_load_ratio"] == 3.0 and s["dead_experts"] == 2
    assert math.isclose(s["load_cv"], math.sqrt(1.5))
    even = load_summary(torch.tensor([5.0, 5.0, 5.0, 5.0]))
    assert even["max_load_ratio"] == 1.0 and even["load_cv"] == 0.0 and even["dead_experts"] == 0
    empty = load_summary([0, 0, 0])
    assert empty["max_load_ratio"] == 0.0 and empty["dead_experts"] == 3
    with pytest.raises(ValueError):
        load_summary([])


def test_fluctuation_rates_by_hand():
    # columns ranked by gate: column 0 is the top-1 expert
    prev = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]])
    cur = torch.tensor([[0, 1], [3, 2], [0, 1], [3, 1], [1, 0]])
    # token 0: nothing changed; 1: top-1 2->3, same set; 2: top-1 1->0, same set;
    # 3: same top-1, set {2,3}->{1,3}; 4: top-1 0->1 and set {0,2}->{0,1}
    assert fluctuation_rates(prev, cur) == {"fluct_top1": 3 / 5, "fluct_topk": 2 / 5}
    assert fluctuation_rates(prev, prev) == {"fluct_top1": 0.0, "fluct_topk": 0.0}
    with pytest.raises(ValueError, match="probe set must stay fixed"):
        fluctuation_rates(prev, cur[:4])


def test_routing_summary_by_hand():
    def row(step, counts, dropped, fluct=None):
        layer = {"expert_counts": counts, "dropped_fraction": dropped, **(fluct or {})}
        return {"step": step, "moe": {"0": layer, "2": {**layer, "expert_counts": [1, 1, 1, 1]}}}

    rows = [row(1, [9, 0, 0, 0], 0.5), row(2, [4, 4, 0, 0], 0.0, {"fluct_top1": 0.5, "fluct_topk": 0.75}),
            row(3, [1, 1, 2, 0], 0.1), row(4, [3, 3, 2, 0], 0.3, {"fluct_top1": 0.25, "fluct_topk": 0.5})]
    got = routing_summary(rows, window=2)  # steps 3-4: counts [4, 4, 4, 0]
    assert got["0"].pop("steps") == [3, 4]
    assert got["0"] == pytest.approx({
        "load_cv": math.sqrt(3) / 3, "max_load_ratio": 4 / 3, "dead_experts": 1, "num_experts": 4,
        "dropped_fraction": 0.2, "fluct_top1": 0.25, "fluct_topk": 0.5, "fluct_top1_mean": 0.375, "probes": 2})
    assert got["2"]["load_cv"] == 0 and got["2"]["max_load_ratio"] == 1 and got["2"]["dead_experts"] == 0
    assert routing_summary(rows)["0"]["steps"] == [4, 4]  # default: the last tenth of the run, at least 1 step
    got["0"]["steps"] = [3, 4]
    text = format_routing_summary(got).splitlines()
    assert text[0].startswith("routing, steps 3-4") and len(text) == 2 + 2
    assert text[2].split() == ["0", "0.577", "1.33", "1/4", "20.0%", "25.0%", "50.0%", "37.5%"]
    no_probe = routing_summary([row(1, [1, 0], 0.0)])["0"]
    assert no_probe["fluct_top1"] is None and "-" in format_routing_summary({"0": no_probe}).splitlines()[2]


def test_ranked_experts_orders_by_gate():
    r = Routing(expert_ids=torch.tensor([[1, 0], [2, 3], [0, 3]]), gates=torch.tensor([[0.3, 0.7], [0.6, 0.4], [0.0, 0.0]]),
                probs=torch.zeros(3, E))
    assert torch.equal(ranked_experts(r), torch.tensor([[0, 1], [2, 3], [0, 3]]))  # ties keep the router's order


class TinyLM(nn.Module):
    """Embedding and two residual MoE layers (blocks 1 and 3), sequences as the routers expect."""

    def __init__(self, router="topk", router_options=None, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, D)
        self.moe = nn.ModuleList(MoELayer(D, MoEArgs(d_ff=24, num_experts=E, top_k=2, router=router,
                                                     router_options=router_options or {},
                                                     expert_kernel="loop"), layer_idx=i) for i in (1, 3))

    def forward(self, tokens, padding_mask=None):
        B, S = tokens.shape
        x = self.embed(tokens)
        for m in self.moe:
            x = x + m(x, RouterInputs(batch_shape=(B, S), padding_mask=padding_mask))
        return x


def probe(seed=5, B=4, S=6):
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def perturb_router(model, layer, scale=0.3, seed=9):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = model.moe[layer].router.base.weight if hasattr(model.moe[layer].router, "base") else model.moe[layer].router.weight
        w.add_(scale * torch.randn(w.shape, generator=g))


def test_probe_fluctuation_on_a_model():
    model = TinyLM()
    model.train()
    tokens = probe()
    pm = torch.ones_like(tokens, dtype=torch.bool)
    pm[1, -2:] = False
    diag = RoutingDiagnostics()
    assert diag.evaluate_probe(model, tokens, step=0, padding_mask=pm) == {}
    assert model.training  # restored
    assert diag.evaluate_probe(model, tokens, step=1, padding_mask=pm) == {
        "1": {"fluct_top1": 0.0, "fluct_topk": 0.0}, "3": {"fluct_top1": 0.0, "fluct_topk": 0.0}}
    before = probe_assignments(model, tokens, pm)
    assert before["1"].shape == (int(pm.sum()), 2)  # real tokens only
    perturb_router(model, 0)  # block 1's router
    after = probe_assignments(model, tokens, pm)
    got = diag.evaluate_probe(model, tokens, step=2, padding_mask=pm)
    for key in ("1", "3"):
        assert got[key] == fluctuation_rates(before[key], after[key])
    assert got["1"]["fluct_top1"] > 0  # the perturbation moved some tokens
    assert [s for s, _ in diag.fluct_history["1"]] == [1, 2]
    # resume: the next evaluation compares against the restored assignments
    restored = RoutingDiagnostics()
    restored.load_state_dict(diag.state_dict())
    assert restored.evaluate_probe(model, tokens, step=3, padding_mask=pm)["1"] == {"fluct_top1": 0.0, "fluct_topk": 0.0}
    assert len(restored.fluct_history["1"]) == 3


def test_update_probe_graphs_and_pngs_with_symphony(tmp_path):
    model = TinyLM(router="symphony", router_options={"init": "identity"})
    tokens = probe(B=3, S=8)
    diag = RoutingDiagnostics()
    for step in range(1, 4):
        model.train()
        model(tokens).sum().backward()
        for m in model.moe:
            m.router.after_optimizer_step(m.context)
        rows = diag.update(step, model)
        if step == 2:
            assert diag.update(step, collect_stats(model)).keys() == {"0", "1"}  # a plain list is keyed by position
            diag.load_history.pop("0"), diag.load_history.pop("1")
        diag.evaluate_probe(model, tokens, step=step)
        assert model.moe[0].router._counts is None  # eval-mode probe forwards do not count
    assert set(rows) == {"1", "3"}
    r = rows["1"]
    counts = model.moe[0].stats.expert_counts
    assert r["load"] == pytest.approx((counts / counts.sum()).tolist())
    assert r["max_load_ratio"] == pytest.approx(float(counts.max() / counts.mean()))
    assert r["dead_experts"] == int((counts == 0).sum())
    assert r["entropy"] == pytest.approx(float(model.moe[0].stats.entropy))
    # the trainer's summary format ({layer: {"expert_counts": [...]}}) works too
    assert diag.update(4, {"1": {"expert_counts": [4, 0, 2, 2]}})["1"]["dead_experts"] == 1
    assert diag.record_graphs(model) == 2
    # the trainer merges these figures into its metrics row; the metrics logger charts the host numbers
    metrics = {k: {**v, **diag.fluct_history[k][-1][1]} for k, v in rows.items()}
    for layer in ("1", "3"):
        for key in ("max_load_ratio", "load_cv", "dead_experts", "entropy", "dropped_fraction", "fluct_top1", "fluct_topk"):
            value = metrics[layer][key]
            assert isinstance(value, (int, float)) and not isinstance(value, bool), (layer, key, value)
    paths = diag.write_pngs(str(tmp_path / "plots"))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["routing_fluctuation.png", "routing_load.png", "symphony_graph.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _two_rank_probe(rank, world, halves):
    groups = build_parallel_groups(2, E)
    model = apply_expert_parallel(TinyLM(), groups)
    tokens = probe(B=4)
    mine = slice(rank * halves, (rank + 1) * halves)
    diag = RoutingDiagnostics()
    diag.evaluate_probe(model, tokens[mine], step=0, group=groups.dp)
    perturb_router(model, 0)
    return diag.evaluate_probe(model, tokens[mine], step=1, group=groups.dp)


def test_fluctuation_over_ranks_equals_one_process():
    """Each of 2 ranks (expert-parallel 2) routes half the probe; the summed counts give the
    single-process rates."""
    got = run_ranks(_two_rank_probe, 2, args=(2,))
    model = TinyLM()
    diag = RoutingDiagnostics()
    diag.evaluate_probe(model, probe(B=4), step=0)
    perturb_router(model, 0)
    want = diag.evaluate_probe(model, probe(B=4), step=1)
    assert want["1"]["fluct_top1"] > 0
    assert got[0] == want and got[1] == want


# ---------------------------------------------------------------- trainer integration, 2 ranks
TRAIN_RUNS = {
    "similarity": ["model.moe.router=similarity", "model.moe.router_options={temperature: 4.0}"],
    # A_{h*} without the likelihood term (tests/test_model.py covers the model with it)
    "attention": ["model.moe.router=attention", "model.moe.router_options={likelihood: false}"],
    "symphony": ["model.moe.router=symphony", "train.activation_checkpointing=true"],
}


def _train_graph_routers(rank, world, root):
    import os

    from moe_dist.config import load_config
    from moe_dist.train.observe.metrics import read_metrics
    from moe_dist.train.loop.trainer import Trainer

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {}
    for name, overrides in TRAIN_RUNS.items():
        run_dir = os.path.join(root, name)
        cfg = load_config(os.path.join(repo, "configs", "test.yaml"), overrides + [
            f"run.dir={run_dir}", f"data.cache_dir={root}/cache", f"data.corpus={repo}/tests/data/python-docs",
            "run.tensorboard=false", "run.progress=false", "train.steps=8", "eval.every=3", "eval.probe_every=2",
            f"run.plots={'true' if name == 'symphony' else 'false'}"])
        trainer = Trainer(cfg)
        try:
            summary = trainer.fit()
            graphs = [(m.router.A.clone(), int(m.router.n_updates)) for m in trainer.moe if hasattr(m.router, "A")]
        finally:
            trainer.close()
        rows = read_metrics(os.path.join(run_dir, "metrics.jsonl")) if rank == 0 else []
        plots = sorted(os.listdir(os.path.join(run_dir, "plots"))) if rank == 0 else []
        out[name] = {"summary": summary, "rows": rows, "graphs": graphs, "plots": plots}
    return out


def test_trainer_logs_routing_diagnostics_for_graph_routers(tmp_path):
    results = run_ranks(_train_graph_routers, 2, args=(str(tmp_path),), timeout=300)
    for name in TRAIN_RUNS:
        rows = results[0][name]["rows"]
        losses = [r["loss"] for r in rows]
        assert rows[-1]["step"] == 8 and losses[-1] < losses[0] - 0.3, f"{name}: {losses}"
        assert results[0][name]["summary"]["train_loss"] == results[1][name]["summary"]["train_loss"]
        for r in rows:
            for layer in r["moe"].values():
                assert {"max_load_ratio", "load_cv", "dead_experts", "entropy", "dropped_fraction"} <= set(layer)
                assert layer["max_load_ratio"] == pytest.approx(max(layer["expert_counts"]) * len(layer["expert_counts"])
                                                                / sum(layer["expert_counts"]))
        evals = [r for r in rows if "val_loss" in r]
        assert [r["step"] for r in evals] == [3, 6, 8]
        # the fluctuation curve: a probe at step 0 (the reference), then every eval.probe_every=2 steps
        probes = [r for r in rows if any("fluct_top1" in layer for layer in r["moe"].values())]
        assert [r["step"] for r in probes] == [2, 4, 6, 8], name
        for r in probes:
            for layer in r["moe"].values():
                assert 0 <= layer["fluct_top1"] <= 1 and 0 <= layer["fluct_topk"] <= 1
    sym = results[0]["symphony"]
    assert "routing_fluctuation.png" in sym["plots"] and "symphony_graph.png" in sym["plots"]
    for (a0, n0), (a1, n1) in zip(sym["graphs"], results[1]["symphony"]["graphs"]):
        assert n0 == n1 == 8 and torch.equal(a0, a1) and a0.abs().sum() > 0  # one graph, bit-identical on both ranks


# ---------------------------------------------------------------- router extras over ranks
EXTRA_ROUTERS = {"similarity": {"temperature": 4.0}, "attention": {}, "symphony": {"init": "identity"}}


def _graph_case(B, S, seed, D=16, H=2, dh=4):
    """Router inputs [B, S, D] and what the model hands an attention-aware router."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, D, generator=g)
    attn = {"queries": torch.randn(B, H, S, dh, generator=g), "keys": torch.randn(B, H, S, dh, generator=g),
            "values": torch.randn(B, H, S, dh, generator=g), "output": torch.randn(B, S, D, generator=g),
            "out_weight": torch.randn(D, H * dh, generator=g) / 3}
    return x, attn


def _extras_run(rank, world, ep):
    """Two micro-batches of whole sequences (uneven per rank); the step's MoE summary."""
    from moe_dist.train.observe.moe_stats import MoEStepStats

    torch.manual_seed(0)
    groups = build_parallel_groups(ep, 8)
    out = {}
    for name, options in EXTRA_ROUTERS.items():
        torch.manual_seed(1)
        layer = MoELayer(16, MoEArgs(d_ff=32, num_experts=8, top_k=2, router=name, router_options=options))
        if name == "symphony":  # a graph that changes choices
            with torch.no_grad():
                layer.router.A.copy_(torch.rand(8, 8, generator=torch.Generator().manual_seed(3)))
        layer = apply_expert_parallel(layer, groups)
        holder = nn.ModuleList([layer])
        stats = MoEStepStats(holder)
        for micro, per_rank in enumerate(([3, 1], [2, 4])):
            B = sum(per_rank)
            S = 6
            x, attn = _graph_case(B, S, seed=10 + micro)
            b0 = sum(per_rank[:rank]) if world > 1 else 0
            nb = per_rank[rank] if world > 1 else B
            mine = AttentionInputs(**{k: v[b0:b0 + nb] if v.dim() > 2 else v for k, v in attn.items()})
            with torch.no_grad():
                layer(x[b0:b0 + nb].reshape(-1, 16), RouterInputs(batch_shape=(nb, S), attention=mine))
            stats.add()
        out[name] = stats.summary(groups.dp if world > 1 else None)
    return out


def test_router_extras_are_reduced_over_ranks():
    """topk_changed / gate_sum (means over tokens) and selected_heads (counts) describe a rank's
    own tokens; the step summary combines them so 2 ranks log what one process would."""
    one = _extras_run(0, 1, 1)
    two = run_ranks(_extras_run, 2, args=(2,))
    for name in EXTRA_ROUTERS:
        ref = one[name]["0"]
        for got in (two[0][name]["0"], two[1][name]["0"]):
            for key in EXTRA_ROUTERS_KEYS[name]:
                assert got[key] == pytest.approx(ref[key], rel=1e-6), (name, key)  # fp32 means inside the router
        changed = ref["topk_changed"]
        assert 0 < changed < 1, f"{name}: topk_changed={changed}; the case checks nothing"
    assert sum(one["attention"]["0"]["selected_heads"]) == 4 + 6  # sequences of both micro-batches


EXTRA_ROUTERS_KEYS = {"similarity": ["topk_changed"], "attention": ["topk_changed", "selected_heads"],
                      "symphony": ["topk_changed", "gate_sum"]}


# ---------------------------------------------------------------- probe assignments across a resume
def _probe_share(rank, world, state):
    """Ranks of a 2-rank layout (ep 2) each route half the probe: save the diagnostics' state
    after one evaluation, or (given a saved state) resume from it and evaluate once more."""
    import json

    groups = build_parallel_groups(2, E)
    model = apply_expert_parallel(TinyLM(), groups)
    mine = slice(rank * 2, (rank + 1) * 2)
    diag = RoutingDiagnostics()
    if state is None:
        diag.evaluate_probe(model, probe(B=4)[mine], step=0, group=groups.dp)
        return json.loads(json.dumps(diag.state_dict(groups.dp)))  # through JSON, as in the checkpoint
    diag.load_state_dict(state)
    perturb_router(model, 0)
    return diag.evaluate_probe(model, probe(B=4)[mine], step=1, group=groups.dp)


def test_probe_assignments_survive_a_resume_in_another_layout():
    """The last probe assignments are saved for the whole probe set: a run saved by 2 ranks and
    resumed by 1 process (and the other way round) compares its first evaluation with them and
    gets the uninterrupted run's rates."""
    import json

    model = TinyLM()
    diag = RoutingDiagnostics()
    diag.evaluate_probe(model, probe(B=4), step=0)
    saved_one = json.loads(json.dumps(diag.state_dict()))
    perturb_router(model, 0)
    want = diag.evaluate_probe(model, probe(B=4), step=1)
    assert want["1"]["fluct_top1"] > 0

    saved_two = run_ranks(_probe_share, 2, args=(None,))
    assert saved_two[0] == saved_two[1] and saved_two[0]["probe_prev"] == saved_one["probe_prev"]
    resumed = RoutingDiagnostics()
    resumed.load_state_dict(saved_two[0])
    model = TinyLM()
    perturb_router(model, 0)
    assert resumed.evaluate_probe(model, probe(B=4), step=1) == want  # 2 ranks -> 1 process
    assert run_ranks(_probe_share, 2, args=(saved_one,)) == [want, want]  # 1 process -> 2 ranks
    # a different probe set (another eval batch) is not compared with the saved one
    other = RoutingDiagnostics()
    other.load_state_dict(saved_one)
    assert other.evaluate_probe(TinyLM(), probe(B=3), step=1) == {}
