"""Checkpoints on real gloo process groups: exact resume, resharding to other world and
expert-parallel sizes (optimizer state included, every router with state), and crashes.

* 4 ranks, ep=4 (FSDP2 dense weights), each router: 6 steps straight, saving at step 3 (and 6);
  then, in the same spawn, a new run resumed from step 3 at the same layout: steps 4-6 give
  bitwise the same losses, and the step-6 checkpoints (weights and optimizer state) are equal
  tensor by tensor.
* the step-3 checkpoint resumed at 2 ranks ep=2, at 4 ranks ep=2 (expert-data-parallel 2,
  replicated dense weights) and at 1 process: losses within 1e-5 of the uninterrupted 4-rank
  run, weights and optimizer state at step 6 within 1e-4 relative (norm of the difference).
* a rank SIGKILLed while a checkpoint is being saved: the previous checkpoint stays loadable,
  the partial one is ignored; `moe-dist train --nproc 2 resume=auto` continues from the last
  complete checkpoint and ends with the same losses, bitwise, as an uninterrupted run.
"""
import json
import os
import random
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers.checkpoint_reading import read_full, rel_diff
from helpers.dist_harness import run_ranks
from moe_dist.config import load_config
from moe_dist.train.checkpoint import IncompleteCheckpoint, latest_checkpoint, load_checkpoint, step_dir

pytestmark = pytest.mark.slow  # real gloo ranks and the CLI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "test.yaml")
STEPS, AT = 6, 3
ROUTERS = {
    "topk": [],
    "symphony": ["model.moe.router=symphony"],  # expert graph A (fp32 buffer) + update counter
    "ac": ["model.moe.router=ac", "model.moe.router_options={start_layer: 1, eval_mode: running}"],  # running stats
    # trainable embedding, frozen hypernetwork buffers, k schedule 2 -> 4 over the 6 steps
    "hyper": ["model.moe.router=hyper", "model.moe.router_options={k_max: 4, k_schedule_steps: 6, embed_dim: 16, "
              "hyper_dim: 32}"],
}
ASYNC = {"symphony", "hyper"}  # their reference runs save in the background


def config(root, router, name, *extra):
    return load_config(CONFIG, [*ROUTERS[router], f"run.dir={root}/{router}/{name}", f"data.cache_dir={root}/cache",
                                f"data.corpus={ROOT}/tests/data/python-docs", "run.tensorboard=false", "run.plots=false",
                                "run.progress=false", f"train.steps={STEPS}", f"eval.every={AT}", *extra])


def fluctuation(rows, step):
    """{layer: (fluct_top1, fluct_topk)} logged at ``step`` (the probe evaluation compares with
    the previous one, which a resumed run restored from the checkpoint)."""
    row = next(r for r in rows if r["step"] == step)
    return {k: (v["fluct_top1"], v["fluct_topk"]) for k, v in row["moe"].items()}


def rows_of(root, router, name):
    with open(os.path.join(root, router, name, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ---- 4 ranks: the reference runs and the same-layout resume -------------------------------------------
def _reference_and_same_layout(rank, world, root):
    from moe_dist.train.trainer import train

    for router in ROUTERS:
        async_save = "true" if router in ASYNC else "false"
        train(config(root, router, "ref", "parallel.ep=4", f"ckpt.every={AT}", f"ckpt.async_save={async_save}"))
        train(config(root, router, "same", "parallel.ep=4", f"resume={step_dir(f'{root}/{router}/ref', AT)}"))


@pytest.fixture(scope="module")
def saved4(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt4"))
    run_ranks(_reference_and_same_layout, 4, args=(root,), timeout=400)
    return root


def test_exact_resume_same_layout(saved4):
    for router in ROUTERS:
        ref, same = rows_of(saved4, router, "ref"), rows_of(saved4, router, "same")
        assert [r["step"] for r in ref] == list(range(1, STEPS + 1)) and ref[-1]["loss"] < ref[0]["loss"]
        assert [r["step"] for r in same] == list(range(AT + 1, STEPS + 1))
        for key in ("loss", "grad_norm", "aux_loss", "lr"):  # bitwise
            assert [r[key] for r in same] == [r[key] for r in ref[AT:]], f"{router}: {key}"
        assert fluctuation(same, STEPS) == fluctuation(ref, STEPS), router  # probe assignments resumed
        a, b = read_full(step_dir(f"{saved4}/{router}/ref", STEPS)), read_full(step_dir(f"{saved4}/{router}/same", STEPS))
        assert set(a) == set(b) and any(k.startswith("optim.") and k.endswith(".exp_avg_sq.expert_3") for k in a)
        for k in a:
            assert torch.equal(a[k], b[k]), f"{router}: {k} differs after resuming at the same layout"
    # the state each router keeps moved on, and was resumed exactly (compared above)
    sym = read_full(step_dir(f"{saved4}/symphony/ref", STEPS))
    assert int(sym["blocks.0.ffn.router.n_updates"]) == STEPS and sym["blocks.0.ffn.router.A"].abs().sum() > 0
    ac = read_full(step_dir(f"{saved4}/ac/ref", STEPS))
    assert ac["blocks.1.ffn.router.running_valid"].any() and not torch.all(ac["blocks.1.ffn.router.running_dispersion"] == 1)
    ks = [r["moe"]["0"]["k"] for r in rows_of(saved4, "hyper", "same")]
    assert ks == [r["moe"]["0"]["k"] for r in rows_of(saved4, "hyper", "ref")][AT:] and ks[-1] == 4


# ---- resharding -----------------------------------------------------------------------------------------
def _resume_at(rank, world, root, name, extra):
    from moe_dist.train.trainer import train

    for router in ROUTERS:
        train(config(root, router, name, f"resume={step_dir(f'{root}/{router}/ref', AT)}", *extra))


def _resume_in_this_process(root, name, extra):
    """1 process without torch.distributed (the resume restores RNG states: keep ours)."""
    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        _resume_at(0, 1, root, name, extra)
    random.setstate(states[0])
    np.random.set_state(states[1])


LAYOUTS = {  # name: (world, overrides)
    "w2-ep2": (2, ["parallel.ep=2"]),
    "w4-ep2-replicate": (4, ["parallel.ep=2", "parallel.dense=replicate"]),
    "w1": (1, ["parallel.ep=1"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resume_at_another_layout(saved4, name):
    world, extra = LAYOUTS[name]
    if world == 1:
        _resume_in_this_process(saved4, name, extra)
    else:
        run_ranks(_resume_at, world, args=(saved4, name, extra), timeout=300)
    for router in ROUTERS:
        ref, got = rows_of(saved4, router, "ref"), rows_of(saved4, router, name)
        assert [r["step"] for r in got] == list(range(AT + 1, STEPS + 1))
        torch.testing.assert_close(torch.tensor([r["loss"] for r in got]), torch.tensor([r["loss"] for r in ref[AT:]]),
                                   rtol=1e-5, atol=0, msg=lambda m: f"{router} at {name}: {m}")
        if router == "hyper":
            assert [r["moe"]["0"]["k"] for r in got] == [r["moe"]["0"]["k"] for r in ref[AT:]]
        flu, flu_ref = fluctuation(got, STEPS), fluctuation(ref, STEPS)  # the saved probe split another way
        assert set(flu) == set(flu_ref) and all(abs(a - b) <= 0.02 for k in flu for a, b in zip(flu[k], flu_ref[k])), \
            (router, name, flu, flu_ref)
        a, b = read_full(step_dir(f"{saved4}/{router}/{name}", STEPS)), read_full(step_dir(f"{saved4}/{router}/ref", STEPS))
        assert set(a) == set(b), f"{router} at {name}: {sorted(set(a) ^ set(b))[:5]}"
        worst = max((rel_diff(a[k], b[k]), k) for k in a)
        print(f"{router} resumed at {name}: largest relative difference at step {STEPS}: {worst[0]:.1e} ({worst[1]})")
        assert worst[0] < 1e-4, f"{router} at {name}: {worst[1]} differs by {worst[0]:.2e} (relative norm)"
        for k in a:  # integer state (Symphony's update count, AC's valid flags) and frozen tensors exactly
            if not a[k].is_floating_point() or "hyper_w" in k:
                assert torch.equal(a[k], b[k]), f"{router} at {name}: {k}"


# ---- crashes ----------------------------------------------------------------------------------------------
CRASH = ["parallel.ep=2", "ckpt.every=2", "train.steps=6"]


def crash_config(root, name, *extra):
    return config(root, "topk", name, *CRASH, *extra)


def _uninterrupted_then_killed_while_saving(rank, world, root):
    from moe_dist.train.checkpoint import checkpointer
    from moe_dist.train.trainer import train

    train(crash_config(root, "uninterrupted"))
    if rank == 1:  # dies while hashing the files it wrote for step 4, before the checkpoint is complete
        real = checkpointer.file_record

        def die_while_saving(path):
            if "step_000004.partial" in path:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(path)

        checkpointer.file_record = die_while_saving
    train(crash_config(root, "killed"))


def test_killed_while_saving_then_resume_auto(tmp_path):
    root = str(tmp_path)
    with pytest.raises(RuntimeError, match="rank 1: no result"):
        run_ranks(_uninterrupted_then_killed_while_saving, 2, args=(root,), timeout=120)
    killed = os.path.join(root, "topk", "killed")
    names = sorted(os.listdir(os.path.join(killed, "checkpoints")))
    assert names == ["step_000002", "step_000004.partial"], names
    assert not os.path.exists(os.path.join(killed, "checkpoints", "step_000004.partial", "COMPLETE"))
    notes = []
    assert latest_checkpoint(killed, log=notes.append).endswith("step_000002")
    assert len(notes) == 1 and "step_000004.partial" in notes[0]
    from moe_dist.model import build_model

    cfg = crash_config(root, "check")
    model = build_model(cfg.model, 512)
    with pytest.raises(IncompleteCheckpoint, match="not a complete checkpoint"):
        load_checkpoint(model, os.path.join(killed, "checkpoints", "step_000004.partial"))
    assert load_checkpoint(model, os.path.join(killed, "checkpoints", "step_000002"))["step"] == 2  # still loadable

    # relaunch the killed run with the real CLI: it continues from step 2, skipping the partial step 4
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    overrides = [f"run.dir={killed}", f"data.cache_dir={root}/cache", f"data.corpus={ROOT}/tests/data/python-docs",
                 "run.tensorboard=false", "run.plots=false", "run.progress=false", *CRASH, "resume=auto"]
    proc = subprocess.run([sys.executable, "-m", "moe_dist.cli", "train", "--config", CONFIG, "--nproc", "2", *overrides],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "removed" in out and "step_000004.partial, left by a save that did not finish" in out, out[-4000:]
    assert "resumed from" in out and "step_000002" in out, out[-4000:]
    rows, ref = rows_of(root, "topk", "killed"), rows_of(root, "topk", "uninterrupted")
    assert [r["step"] for r in rows] == list(range(1, 7))  # rows of the lost steps 3-4 were replaced
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref]  # bitwise, final loss included
    assert sorted(os.listdir(os.path.join(killed, "checkpoints"))) == ["step_000002", "step_000004", "step_000006"]


# ---- moe-dist convert ---------------------------------------------------------------------------------------
def test_convert_consolidates_a_sharded_checkpoint_for_one_process(saved4, tmp_path, capsys):
    import torch.distributed as dist
    from safetensors import safe_open
    from safetensors.torch import load_file

    from moe_dist.cli import main
    from moe_dist.config import config_from_dict
    from moe_dist.model import build_model

    run = f"{saved4}/symphony/ref"  # saved by 4 ranks, ep=4, FSDP2; a run directory means its latest checkpoint
    out = str(tmp_path / "one")
    assert main(["convert", "--checkpoint", run, "--out", out]) == 0
    assert not dist.is_initialized()
    path = os.path.join(out, "model.safetensors")
    with safe_open(path, framework="pt") as f:
        header = f.metadata()
    assert header["step"] == str(STEPS) and json.loads(header["saved_layout"])["ep"] == 4
    cfg = config_from_dict(json.loads(header["config"]))
    assert cfg.model.moe.router == "symphony" and cfg.resume == "none"
    assert load_config(os.path.join(out, "config.yaml")).model == cfg.model
    assert json.load(open(os.path.join(out, "convert.json")))["source"] == step_dir(run, STEPS)

    model = build_model(cfg.model, cfg.model.vocab_size, seed=123)
    model.load_state_dict(load_file(path))  # strict: every tensor, whole experts, no torch.distributed
    full = read_full(step_dir(run, STEPS))
    for name, t in model.state_dict().items():
        if name.endswith((".w1", ".w2", ".w3")) and ".experts." in name:
            for e in range(t.shape[0]):
                assert torch.equal(t[e], full[f"{name}.expert_{e}"]), f"{name} expert {e}"
        else:
            assert torch.equal(t, full[name]), name
    reference = build_model(cfg.model, cfg.model.vocab_size, seed=7)
    load_checkpoint(reference, step_dir(run, STEPS))
    x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(x), reference.eval()(x))

    assert main(["convert", "--checkpoint", run, "--out", out, "--dtype", "bf16"]) == 2  # not over an existing output
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["convert", "--checkpoint", run, "--out", out, "--dtype", "bf16", "--force"]) == 0
    assert load_file(path)["blocks.0.ffn.experts.w1"].dtype == torch.bfloat16
    damaged = str(tmp_path / "damaged" / "checkpoints" / f"step_{AT:06d}")
    import shutil

    shutil.copytree(step_dir(run, AT), damaged)
    with open(os.path.join(damaged, "__3_0.distcp"), "r+b") as f:
        f.truncate(100)
    assert main(["convert", "--checkpoint", damaged, "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert "__3_0.distcp: 100 bytes" in err and not os.path.exists(tmp_path / "never")
