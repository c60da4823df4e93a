"""End to end: the trainer on the test config, 2 gloo ranks (expert-parallel 2), one short
run per router of issue 4. Each run completes, its training loss falls, and the router's
own statistics reach metrics.jsonl."""
import os

import pytest

from helpers.dist_harness import run_ranks

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "test.yaml")
RUNS = {
    # p = 0.5: both branches occur in 8 steps x 2 layers
    "ssr": ["model.moe.router=ssr", "model.moe.router_options={p: 0.5, noise_alpha: 1.0}", "model.moe.aux_loss_coef=0"],
    "sinkhorn": ["model.moe.router=sinkhorn"],
    "hyper": ["model.moe.router=hyper", "model.moe.router_options={k_max: 4, k_schedule_steps: 8, embed_dim: 16, hyper_dim: 32}"],
    "smoe_dropout": ["model.moe.router=smoe_dropout", "model.moe.router_options={k_max: 4, k_schedule_steps: 8}"],
    # AC on the second MoE layer, with activation checkpointing (recompute must not update the EMA twice)
    "ac": ["model.moe.router=ac", "model.moe.router_options={start_layer: 1, eval_mode: running}",
           "train.activation_checkpointing=true"],
}
ROUTER_METRIC = {"ssr": "sinkhorn_calls_total", "sinkhorn": "sinkhorn_iters", "hyper": "k", "smoe_dropout": "k",
                 "ac": "ac_cluster_sizes"}


def _train_all(rank, world, root):
    from moe_dist.config import load_config
    from moe_dist.train.observe.metrics import read_metrics
    from moe_dist.train.loop.trainer import train

    out = {}
    for name, overrides in RUNS.items():
        run_dir = os.path.join(root, name)
        cfg = load_config(CONFIG, overrides + [f"run.dir={run_dir}", "run.plots=false", "run.tensorboard=false",
                                               "run.progress=false", "train.steps=8"])
        summary = train(cfg)
        rows = read_metrics(os.path.join(run_dir, "metrics.jsonl")) if rank == 0 else []
        out[name] = {"summary": summary, "rows": rows}
    return out


def test_trainer_runs_each_router(tmp_path):
    results = run_ranks(_train_all, 2, args=(str(tmp_path),), timeout=240)
    for name in RUNS:
        rows = results[0][name]["rows"]
        losses = [r["loss"] for r in rows]
        assert rows[-1]["step"] == 8, name
        assert losses[-1] < losses[0] - 0.3, f"{name}: training loss did not fall: {losses}"
        assert results[0][name]["summary"]["train_loss"] == results[1][name]["summary"]["train_loss"]
        last = rows[-1]["moe"]
        assert any(ROUTER_METRIC[name] in layer for layer in last.values()), f"{name}: {ROUTER_METRIC[name]} not logged"
    ssr_last = results[0]["ssr"]["rows"][-1]["moe"]
    assert 0 < sum(layer["sinkhorn_calls_total"] for layer in ssr_last.values()) < 16  # some of 8 steps x 2 layers
    hyper_k = [r["moe"]["0"]["k"] for r in results[0]["hyper"]["rows"]]
    assert hyper_k[0] == 2 and hyper_k[-1] == 4 and hyper_k == sorted(hyper_k)
