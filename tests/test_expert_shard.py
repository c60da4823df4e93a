"""Experts split inside every expert over their replicas (``parallel.expert_shard``), on real gloo
process groups.

A 2-expert model (top-1, expert bias on, 2 micro-batches per step): at 4 ranks ep=2 each rank has
one local expert and two replicas of it (``auto`` splits each expert on dim 1), at 4 ranks ep=1
two local experts over four replicas (``auto``: dim 1 again), at 2 ranks ep=1 two over two
(``auto``: whole experts, ``within`` forced: dim 1), and ``experts`` forced at 4 ranks ep=2 (whole
experts, one replica holding none: FSDP2 pads), and at 4 ranks ep=2 the gradients reduce-scattered
after every micro-batch (``parallel.grad_sync=microbatch``). Every layout fills the same weights as one
process, keeps an even share, trains to the same losses, and a checkpoint saved under one split
resumes under the other and at another number of ranks, both ways, as the uninterrupted run.
"""
import json
import os
import random

import numpy as np
import pytest
import torch

from helpers.checkpoint_reading import read_full, rel_diff
from helpers.dist_harness import run_ranks
from helpers.model_pieces import local_numel, pieces
from moe_dist.config import load_config
from moe_dist.errors import ConfigError
from moe_dist.parallel.expert_shard import busiest_share, gathered_fraction, padded_experts, shard_dim
from moe_dist.train.checkpoint import step_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, AT = 4, 2
MODEL = ["model.moe.num_experts=2", "model.moe.top_k=1", "model.moe.expert_bias=true", "train.grad_accum=2"]
RUNS = {  # name: (world, overrides)
    "w2-ep1": (2, ["parallel.ep=1"]),  # two local experts over two replicas: whole experts
    "w2-ep1-within": (2, ["parallel.ep=1", "parallel.expert_shard=within"]),
    "w4-ep2": (4, ["parallel.ep=2"]),  # one local expert over two replicas: split inside
    "w4-ep1": (4, ["parallel.ep=1"]),  # two over four: split inside
    "w4-ep2-experts": (4, ["parallel.ep=2", "parallel.expert_shard=experts"]),  # padded: one replica holds none
    "w4-ep2-micro": (4, ["parallel.ep=2", "parallel.grad_sync=microbatch"]),  # reduce-scatter every micro-batch
}


def config(root, name, *extra):
    return load_config(os.path.join(ROOT, "configs/test.yaml"), [
        *MODEL, f"run.dir={root}/{name}", f"data.cache_dir={root}/cache", f"data.corpus={ROOT}/tests/data/python-docs",
        "run.tensorboard=false", "run.plots=false", "run.progress=false", "model.vocab_size=512",
        f"train.steps={STEPS}", f"ckpt.every={AT}", "train.lr=0.003", *extra])


def losses(root, name):
    with open(os.path.join(root, name, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r["step"] for r in rows], [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


# ---- the rule ---------------------------------------------------------------------------------------------
def test_the_rule_splits_on_experts_when_even_else_inside_them():
    assert shard_dim((4, 64, 128), 2) == 0 and shard_dim((4, 64, 128), 4) == 0  # edp divides E_local
    assert shard_dim((1, 64, 128), 2) == 1 and shard_dim((2, 64, 128), 4) == 1  # fewer experts than replicas
    assert shard_dim((2, 6, 128), 4) == 2  # dim 1 does not divide: the next one
    assert shard_dim((2, 6, 10), 4) == 0 and gathered_fraction((2, 6, 10), 4) == 2.0  # none divides: FSDP2 pads
    assert shard_dim((4, 64, 128), 2, "within") == 1 and shard_dim((1, 64, 128), 2, "experts") == 0
    assert shard_dim((1, 64, 128), 1) == 0  # one replica: nothing to split
    assert padded_experts(1, 8) == 8 and padded_experts(3, 2) == 4
    assert busiest_share((1, 64, 128), 8) == 1 / 8 and busiest_share((1, 64, 128), 8, "experts") == 1.0
    assert gathered_fraction((1, 64, 128), 8) == 1.0 and gathered_fraction((1, 64, 128), 8, "experts") == 8.0
    with pytest.raises(ConfigError, match=r"^parallel.expert_shard: within, but edp=4 divides no dimension"):
        shard_dim((2, 6, 10), 4, "within")


@pytest.mark.parametrize("key,values", [("parallel.expert_shard", ("auto", "experts", "within")),
                                        ("parallel.grad_sync", ("step", "microbatch"))])
def test_the_config_keys_name_their_values(key, values):
    with pytest.raises(ConfigError) as e:
        config("/tmp", "x", f"{key}=rows")
    msg = str(e.value)
    assert msg.startswith(key) and all(v in msg for v in values) and "\n" not in msg


def test_within_is_refused_before_launch_where_no_dimension_divides(tmp_path, capsys):
    from moe_dist.cli import main

    # 3 replicas of 4 local experts of 64 x 64: neither the experts nor either dimension split 3 ways
    assert main(["train", "--config", os.path.join(ROOT, "configs/test.yaml"), "--nproc", "3", "parallel.ep=1",
                 "train.global_batch=9", "parallel.expert_shard=within", f"run.dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("parallel.expert_shard: within, but edp=3 divides no dimension of the expert weights "
                            "[64, 64]; allowed: auto, experts"), err
    assert not os.path.exists(tmp_path / "run")


# ---- filled rank-locally: the same weights as one process, an even share each --------------------------------
def _fill(rank, world, root, extra, weights):
    from moe_dist.distributed.bootstrap import init_distributed
    from moe_dist.parallel import expert_parameters
    from moe_dist.train.setup.model import build_meta_model, weights_filler
    from moe_dist.parallel.parallelize import parallelize

    cfg = config(root, "fill", *extra)
    rt = init_distributed(cfg.parallel.ep, cfg.model.moe.num_experts, backend="gloo")
    model = build_meta_model(cfg, 512)
    parallelize(model, rt, cfg.parallel, fill=weights_filler(cfg, weights))
    dims = sorted({p.placements[0].dim for p in expert_parameters(model) if hasattr(p, "placements")})
    return {"pieces": pieces(model), "expert_numel": local_numel(expert_parameters(model)), "dims": dims}


@pytest.mark.parametrize("name,source", [("w4-ep2", "seed"), ("w4-ep1", "weights"), ("w2-ep1-within", "weights")])
def test_each_replica_fills_its_block_of_every_expert(tmp_path, name, source):
    from moe_dist.model import build_model
    from moe_dist.train.checkpoint import expert_keyed_state_dict
    from moe_dist.weights import save_model_weights

    world, extra = RUNS[name]
    cfg = config(str(tmp_path), "fill")
    whole = build_model(cfg.model, 512, seed=cfg.train.seed if source == "seed" else 321)
    weights = None
    if source == "weights":  # another seed's model on disk: each rank reads only its block of each expert
        weights = str(tmp_path / "weights")
        save_model_weights(whole, weights)
    ref = expert_keyed_state_dict(whole)
    ref_expert = sum(p.numel() for n, p in whole.named_parameters() if ".experts." in n)
    results = run_ranks(_fill, world, args=(str(tmp_path), extra, weights), timeout=240)
    for res in results:
        assert res["dims"] == [1], res["dims"]  # every expert weight split on its second dimension
        assert res["expert_numel"] == ref_expert // world  # an even share: no replica holds whole experts
        for key, t in res["pieces"].items():
            assert torch.equal(t, ref[key]), key


# ---- training: the same losses; resume and reshard between the splits and rank counts ----------------------
def _runs(rank, world, root, runs):
    """``runs``: ``(name, overrides)``; a resumed run names its source with ``resume=``."""
    from moe_dist.train.loop.trainer import train

    for name, extra in runs:
        train(config(root, name, *extra))


def _resume(source, *extra):
    return [f"resume={step_dir(source, AT)}", *extra]


def _in_this_process(fn, *args):
    """1 process without torch.distributed (a resume restores RNG states: keep ours)."""
    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        fn(0, 1, *args)
    random.setstate(states[0])
    np.random.set_state(states[1])


RESUMES = ("r-w2-to-w4", "r-w1-to-w4", "r-w4-to-w2", "r-w4-to-w1")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("expert_shard"))
    at = lambda name: f"{root}/{name}"  # noqa: E731
    _in_this_process(_runs, root, [("w1", ["parallel.ep=1"])])
    run_ranks(_runs, 2, args=(root, [(n, RUNS[n][1]) for n in RUNS if RUNS[n][0] == 2]), timeout=400)
    # split inside at 4 ranks, from checkpoints saved with whole experts at 2 ranks and at one process
    run_ranks(_runs, 4, args=(root, [(n, RUNS[n][1]) for n in RUNS if RUNS[n][0] == 4] + [
        ("r-w2-to-w4", _resume(at("w2-ep1"), "parallel.ep=2")), ("r-w1-to-w4", _resume(at("w1"), "parallel.ep=2"))]),
        timeout=400)
    # whole experts at 2 ranks and one process, from the checkpoint saved split inside at 4 ranks
    run_ranks(_runs, 2, args=(root, [("r-w4-to-w2", _resume(at("w4-ep2"), "parallel.ep=1"))]), timeout=300)
    _in_this_process(_runs, root, [("r-w4-to-w1", _resume(at("w4-ep2"), "parallel.ep=1"))])
    return root


def test_losses_at_every_layout_equal_one_process(trained):
    steps, ref, ref_norm = losses(trained, "w1")
    assert steps == list(range(1, STEPS + 1)) and ref[-1] < ref[0]
    for name in RUNS:
        got_steps, got, norm = losses(trained, name)
        assert got_steps == steps, name
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(torch.tensor(norm), torch.tensor(ref_norm), rtol=2e-4, atol=0,
                                   msg=lambda m: f"{name} grad norm: {m}")


@pytest.mark.parametrize("name", RESUMES)
def test_resume_across_splits_and_rank_counts_equals_the_uninterrupted_run(trained, name):
    steps, ref, _ = losses(trained, "w1")
    got_steps, got, _ = losses(trained, name)
    assert got_steps == steps[AT:], name
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref[AT:]), rtol=1e-5, atol=0, msg=lambda m: f"{name}: {m}")
    final = read_full(step_dir(f"{trained}/w1", STEPS))  # weights, AdamW state and the expert bias
    state = read_full(step_dir(f"{trained}/{name}", STEPS))
    assert set(state) == set(final), name
    worst = max((rel_diff(state[k], final[k]), k) for k in final)
    assert worst[0] < 1e-4, f"{name}: {worst[1]} differs by {worst[0]:.2e}"


def test_convert_and_the_export_loader_read_a_checkpoint_split_inside_the_experts(trained, tmp_path):
    from safetensors.torch import load_file

    from moe_dist.cli import main
    from moe_dist.hf.export import load_our_model
    from moe_dist.train.checkpoint.files import read_manifest

    run = f"{trained}/w4-ep2"  # saved by 4 ranks, each holding half of every expert of its ep group
    out = str(tmp_path / "one")
    assert main(["convert", "--checkpoint", run, "--out", out]) == 0
    layout = json.load(open(os.path.join(out, "convert.json")))["saved_layout"]
    assert layout["world_size"] == 4 and layout["expert_split"] == "within", layout
    assert read_manifest(step_dir(f"{trained}/w2-ep1", STEPS))["layout"]["expert_split"] == "experts"
    weights = load_file(os.path.join(out, "model.safetensors"))
    full = read_full(step_dir(run, STEPS))
    ours, _, _ = load_our_model(run)  # what `moe-dist export` converts to a Hugging Face format
    for name, t in ours.state_dict().items():
        assert torch.equal(weights[name], t), name
        if ".experts.w" in name:
            for e in range(t.shape[0]):
                assert torch.equal(t[e], full[f"{name}.expert_{e}"]), f"{name} expert {e}"


# ---- the dry run and the planner count the split -----------------------------------------------------------
DRY = ["model.n_layers=2", "train.seq_len=256", "train.global_batch=16", "model.vocab_size=4096", "train.dtype=fp32",
       "parallel.ep=8", "eval.batch=16"]  # 16 ranks: one local expert per layer, two replicas of it


def test_every_replica_holds_an_even_share_in_the_dry_run_and_the_planner_agrees():
    from moe_dist.plan.dry_run import dry_run
    from moe_dist.plan.dry_run_report import comparison_rows, with_planner

    def weights(rank, *extra):
        result = dry_run("configs/tiny.yaml", DRY + list(extra), nodes=2, gpus_per_node=8, rank=rank)
        return result, result["categories_bytes"]["weights"], result["categories_bytes"]["optimizer"]

    first, w0, o0 = weights(0)
    _, w8, o8 = weights(8)  # rank 8: the other replica of rank 0's experts
    assert first["layout"]["edp"] == 2 and first["layout"]["experts_per_rank"] == 1
    assert w8 == pytest.approx(w0, rel=0.05) and o8 == pytest.approx(o0, rel=0.05)
    planned = with_planner(first)
    for name, got, want in comparison_rows(planned):
        if name in ("weights (this rank's shards)", "optimizer state", "gradients", "peak"):
            assert want == pytest.approx(got, rel=0.05, abs=2e-3), name
    # whole experts (parallel.expert_shard=experts): rank 0 holds its expert, rank 8 none of it
    _, we0, _ = weights(0, "parallel.expert_shard=experts")
    _, we8, _ = weights(8, "parallel.expert_shard=experts")
    assert we0 > w0 > we8 and we0 - we8 == pytest.approx(2 * (w0 - we8), rel=0.05)


@pytest.mark.parametrize("grad_sync", ["step", "microbatch"])
def test_the_planner_counts_the_gradients_of_either_grad_sync_as_the_dry_run(grad_sync):
    from moe_dist.plan.dry_run import dry_run
    from moe_dist.plan.dry_run_report import comparison_rows, with_planner

    result = with_planner(dry_run("configs/tiny.yaml", DRY + ["train.grad_accum=2", "train.global_batch=32",
                                                        f"parallel.grad_sync={grad_sync}"],
                                  nodes=2, gpus_per_node=8))
    rows = {name: (got, want) for name, got, want in comparison_rows(result)}
    for name in ("gradients", "peak"):
        got, want = rows[name]
        assert want == pytest.approx(got, rel=0.05, abs=2e-3), (name, got, want)
    weights = rows["weights (this rank's shards)"][0]
    if grad_sync == "step":  # every unit's unsharded gradient: more than this rank's shards of the weights
        assert rows["gradients"][0] > 4 * weights
    else:  # sharded, as the weights
        assert rows["gradients"][0] == pytest.approx(weights, rel=0.05)


def test_every_rank_of_a_real_gloo_world_with_experts_split_inside_equals_its_dry_run():
    """4 real gloo ranks at ep=2 with each expert split inside over its 2 replicas measure their
    step with the tracker on real tensors; the dry run of each rank, replaying their routing, gives
    every category within 0.1%."""
    from helpers.dry_run_cases import CONFIG, SMALL, real_rank, replay
    from moe_dist.plan.dry_run import dry_run

    overrides = SMALL + ["parallel.ep=2", "parallel.expert_shard=within", "train.grad_accum=2"]
    real = run_ranks(real_rank, 4, args=(overrides,), timeout=300)
    for rank in range(4):
        fake = dry_run(CONFIG, overrides, nodes=1, gpus_per_node=4, rank=rank, routing=replay(real))
        want, got = real[rank]["categories_bytes"], fake["categories_bytes"]
        assert set(k for k, v in want.items() if v) == set(k for k, v in got.items() if v)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-3, abs=4096), (rank, key)
        assert fake["peak_bytes"] == pytest.approx(real[rank]["peak_bytes"], rel=1e-3)


def _on_meta_default(rank, world, root):
    """Train 2 steps, save, resume for a third with the experts split inside and the default
    device on ``meta``: a tensor made without a device (the GPU-readiness check of
    tests/test_default_device_meta.py) fails at its first use beside real ones."""
    from moe_dist.train.loop.trainer import train

    losses_of = []
    for steps, extra in ((2, []), (3, ["resume=auto"])):
        torch.set_default_device("meta")
        try:
            train(config(root, "meta", "parallel.ep=1", "parallel.expert_shard=within", f"train.steps={steps}",
                         "ckpt.every=2", *extra))
        finally:
            torch.set_default_device("cpu")
        losses_of.append(losses(root, "meta")[1])
    return losses_of


def test_the_split_inside_trains_saves_and_resumes_with_the_default_device_on_meta(tmp_path):
    first, resumed = run_ranks(_on_meta_default, 2, args=(str(tmp_path),), timeout=300)[0]
    assert len(first) == 2 and len(resumed) == 3 and all(torch.isfinite(torch.tensor(resumed)))
