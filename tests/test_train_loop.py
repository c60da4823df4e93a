"""The training loop on one process: the loss falls on real text, the run directory holds
everything, and the optimizer, schedule, clipping and checkpoint pieces do what they say."""
import contextlib
import io
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml

from moe_dist.config import load_config
from moe_dist.data import load_prepared, prepare_data
from moe_dist.distributed.bootstrap import init_distributed
from moe_dist.model import build_model
from moe_dist.train.checkpoint import expert_keyed_state_dict, latest_checkpoint, load_checkpoint, save_checkpoint
from moe_dist.train.loop.optim import build_optimizer, lr_at
from moe_dist.parallel.parallelize import parallelize
from moe_dist.train.loop.trainer import train
from moe_dist.moe import moe_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG = b"\x89PNG\r\n\x1a\n"


def config(tmp, *extra):
    return load_config(os.path.join(ROOT, "configs/test.yaml"), [
        f"run.dir={tmp}/run", f"data.cache_dir={tmp}/cache", f"data.corpus={ROOT}/tests/data/python-docs",
        "parallel.ep=1", *extra])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loop")
    cfg = config(tmp, "train.steps=60", "train.warmup_steps=5", "eval.every=30", "ckpt.every=30", "run.log_every=2",
                 "run.progress=true")
    bar = io.StringIO()
    with contextlib.redirect_stderr(bar):
        summary = train(cfg)
    return cfg, summary, bar.getvalue()


@pytest.mark.slow
def test_loss_falls_on_real_text(run):
    cfg, summary, _ = run
    rows = [json.loads(line) for line in open(os.path.join(cfg.run.dir, "metrics.jsonl"))]
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert first == pytest.approx(math.log(512), abs=0.1)  # starts at chance
    assert last < first - 1.0
    # and it learned more than token frequencies: validation beats the unigram baseline
    assert summary["val_loss"] < summary["unigram_loss"]
    assert summary["val_ppl"] == pytest.approx(math.exp(summary["val_loss"]))


@pytest.mark.slow
def test_run_directory_has_everything(run):
    cfg, summary, bar = run
    assert "60/60" in bar and "tok_s=" in bar  # rank 0's progress bar
    d = cfg.run.dir
    saved = yaml.safe_load(open(os.path.join(d, "config.yaml")))
    assert saved["model"]["vocab_size"] == 512 and saved["train"]["steps"] == 60  # resolved config
    rows = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1] + list(range(2, 61, 2))
    for r in rows:
        for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "cpu_s", "aux_loss"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), key
        assert set(r["moe"]) == {"0", "1"}
        for layer in r["moe"].values():
            assert len(layer["expert_counts"]) == 4 and sum(layer["expert_counts"]) == 8 * 64 * 2  # tokens x top-2
            assert layer["dropped_fraction"] == 0.0  # dropless
            assert layer["aux_loss"] > 0 and 0 < layer["entropy"] <= math.log(4) + 1e-6
    assert [r["step"] for r in rows if "val_loss" in r] == [30, 60]
    assert rows[0]["lr"] == pytest.approx(lr_at(0, cfg.train))
    for name in ("loss.png", "expert_load.png"):
        with open(os.path.join(d, "plots", name), "rb") as f:
            assert f.read(8) == PNG
        assert os.path.getsize(os.path.join(d, "plots", name)) > 10_000
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(os.path.join(d, "tb")))
    assert sorted(os.listdir(os.path.join(d, "checkpoints"))) == ["step_000030", "step_000060"]
    assert latest_checkpoint(d).endswith("step_000060")
    info = json.load(open(os.path.join(d, "run.json")))
    assert info["world_size"] == 1 and info["parameters"]["total"] == summary["parameters"]["total"]
    assert json.load(open(os.path.join(d, "summary.json")))["val_ppl"] == pytest.approx(summary["val_ppl"])
    assert len(summary["peak_rss_gib"]) == 1 and 0.05 < summary["peak_rss_gib"][0] < 64  # one rank's peak memory


def test_where_the_time_goes_every_time_every_steps(run):
    """run.time_every (20): steps 20, 40 and 60 are profiled and their rows split the step; every
    row from the first profiled step on carries the MFU; summary.json and TensorBoard have them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from moe_dist.train.observe.step_time import SPLIT

    cfg, summary, _ = run
    assert cfg.run.time_every == 20
    rows = [json.loads(line) for line in open(os.path.join(cfg.run.dir, "metrics.jsonl"))]
    timed = {r["step"]: r["time"] for r in rows if "time" in r}
    assert sorted(timed) == [20, 40, 60]
    for t in timed.values():
        parts = [t[f"{p}_s"] for p in SPLIT + ("compute",)]
        assert sum(parts) == pytest.approx(t["step_s"], rel=0.02) and t["compute_s"] > 0 and t["optimizer_s"] > 0
        assert t["a2a_s"] == t["weight_gather_s"] == t["grad_reduce_s"] == 0  # one process: nothing to wait for
        assert t["data_s"] >= 0
    assert all(t["eval_s"] > 0 for t in timed.values())  # the routing probe every 10 steps, validation at 60
    assert [r["step"] for r in rows if "mfu" in r] == [r["step"] for r in rows if r["step"] >= 20]
    assert all(0 < r["mfu"] < 1 for r in rows if "mfu" in r)
    time = json.load(open(os.path.join(cfg.run.dir, "summary.json")))["time"]
    assert time == summary["time"] and time["profiled_steps"] == 3 and 0 < time["mfu"] < 1
    assert time["seconds"]["step"] > 0 and time["seconds"]["checkpoint"] > 0 and time["seconds"]["eval"] > 0
    assert sum(time["step_split_s"].values()) == pytest.approx(time["seconds"]["step"], abs=0.01)
    assert "fp32 1024^3 matmul measured" in time["peak"]
    tb = EventAccumulator(os.path.join(cfg.run.dir, "tb"))
    tb.Reload()
    assert [e.step for e in tb.Scalars("time/compute_s")] == [20, 40, 60]
    assert [e.step for e in tb.Scalars("train/mfu")][0] == 20


def test_schedule_and_optimizer_groups(tmp_path):
    cfg = config(tmp_path, "train.steps=100", "train.warmup_steps=10", "train.lr=0.01", "train.min_lr_ratio=0.1")
    lrs = [lr_at(s, cfg.train) for s in range(100)]
    assert lrs[0] == pytest.approx(0.001) and lrs[9] == pytest.approx(0.01)
    assert lrs[-1] == pytest.approx(0.001) and all(a >= b - 1e-12 for a, b in zip(lrs[9:], lrs[10:]))
    assert lr_at(0, config(tmp_path, "train.steps=3", "train.warmup_steps=10").train) > 0  # warm-up capped at steps
    model = build_model(cfg.model, 512)
    opt = build_optimizer(model, cfg.train)
    groups = {g["name"]: g for g in opt.param_groups}
    assert groups["dense_no_decay"]["weight_decay"] == 0 and all(p.dim() == 1 for p in groups["dense_no_decay"]["params"])
    assert {id(p) for p in groups["experts"]["params"]} == {id(p) for m in moe_layers(model)
                                                           for p in m.experts.expert_parameters()}
    n_unique = len({id(p) for p in model.parameters()})
    assert sum(len(g["params"]) for g in opt.param_groups) == n_unique  # tied weights once


def test_grad_norm_and_clipping_single_process(tmp_path):
    cfg = config(tmp_path)
    rt = init_distributed(1, 4, environ={})
    model = build_model(cfg.model, 512, seed=0)
    par = parallelize(model, rt, cfg.parallel)
    x = torch.randint(0, 512, (4, 33), generator=torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert float(par.grad_norm()) == pytest.approx(float(expected), rel=1e-6)
    before = par.clip_gradients(expected.item() / 4)
    assert before == pytest.approx(float(expected), rel=1e-6)
    assert float(par.grad_norm()) == pytest.approx(expected.item() / 4, rel=1e-4)


def test_checkpoint_keys_are_global_experts_and_round_trip(tmp_path):
    cfg = config(tmp_path)
    data = load_prepared(prepare_data(cfg.data, log=lambda _: None))
    model = build_model(cfg.model, data.vocab_size, seed=0)
    keys = expert_keyed_state_dict(model)
    assert "blocks.0.ffn.experts.w1" not in keys
    assert {f"blocks.1.ffn.experts.w2.expert_{e}" for e in range(4)} <= set(keys)
    assert keys["blocks.0.ffn.experts.w1.expert_3"].shape == (64, 64)
    path = save_checkpoint(model, str(tmp_path / "run"), 7, {"note": "x"})
    other = build_model(cfg.model, data.vocab_size, seed=1)
    assert not torch.equal(other.blocks[0].ffn.experts.w1, model.blocks[0].ffn.experts.w1)
    meta = load_checkpoint(other, path)
    assert meta == {"step": 7, "note": "x"}
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_checkpoint(other, str(tmp_path))


def test_bf16_on_a_cpu_without_bf16_matmuls_runs_as_fp32(monkeypatch, tmp_path, capsys):
    """The decision with the timed probe mocked both ways: a slow probe turns train.dtype=bf16 into
    fp32 with one line naming the ratio, the model-sized shape and the key that keeps bf16; a fast
    probe and GPUs keep bf16; the runtime probes at the model's size."""
    from moe_dist.tuning import bf16
    from moe_dist.train.setup.runtime import setup_runtime

    cpu = torch.device("cpu")
    shapes = []

    def slow(*shape):
        shapes.append(shape)
        return 87.0

    monkeypatch.setattr(bf16, "bf16_matmul_slowdown", slow)
    dtype, note = bf16.bf16_choice(cpu, "bf16")
    assert dtype == "fp32" and "87.0x slower" in note and "(256x512 by 512x512)" in note
    assert "train.bf16_on_slow_cpu=bf16" in note
    dtype, note = bf16.bf16_choice(cpu, "bf16", "bf16")
    assert dtype == "bf16" and note.startswith("warning:") and "train.dtype=fp32" in note
    assert bf16.bf16_choice(cpu, "fp32") == ("fp32", None)
    assert bf16.bf16_choice(torch.device("cuda"), "bf16") == ("bf16", None)  # GPUs have their own bf16 units
    assert bf16.bf16_choice(cpu, "bf16", agree=lambda r: 1.0) == ("bf16", None)  # another rank's figure decides
    note = bf16.slow_bf16_note(cpu, "bf16")  # what the benchmarks print (they time the dtype they name)
    assert note and "87.0x" in note and bf16.slow_bf16_note(cpu, "fp32") is None
    # the runtime every command sets up (train, eval, eval --checkpoint) applies it, rank 0 says it once
    cfg = load_config(os.path.join(ROOT, "configs/test.yaml"), [f"run.dir={tmp_path}/run", "parallel.ep=1",
                                                              "train.dtype=bf16"])
    shapes.clear()
    setup_runtime(cfg)
    assert cfg.train.dtype == "fp32"
    assert capsys.readouterr().out.count("train.dtype=bf16 runs as fp32") == 1
    d_ff = cfg.model.moe.d_ff or cfg.model.d_ff
    assert shapes == [(cfg.train.global_batch * cfg.train.seq_len, cfg.model.d_model, d_ff)]  # one rank's micro-batch
    # bf16 kept: the warning, said once although `train` and its Trainer both check the runtime
    kept = load_config(os.path.join(ROOT, "configs/test.yaml"), [f"run.dir={tmp_path}/run", "parallel.ep=1",
                                                               "train.dtype=bf16", "train.bf16_on_slow_cpu=bf16"])
    setup_runtime(kept, setup_runtime(kept))
    assert kept.train.dtype == "bf16" and capsys.readouterr().out.count("warning: train.dtype=bf16 kept") == 1
    assert bf16.probe_shape(10**6, 4096, 14336) == (16, 4096, 2288)  # a 7B model's: the work held near PROBE_FLOPS
    assert bf16.probe_shape(8192, 256, 512) == (1144, 256, 512)
    monkeypatch.setattr(bf16, "bf16_matmul_slowdown", lambda *shape: 1.3)  # fast enough: bf16 stays
    assert bf16.bf16_choice(cpu, "bf16") == ("bf16", None)


def test_the_bf16_probe_finds_the_fallback_path_under_load():
    """The trap for real: oneDNN and ATen limited to AVX2 (ATEN_CPU_CAPABILITY=avx2
    ONEDNN_MAX_CPU_ISA=AVX2 here, or an AVX2-only CPU) send bf16 matmuls to a path tens of times
    slower than fp32; with two busy processes beside it the model-sized probe still says so."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    code = ("import torch; from moe_dist.tuning import bf16; "
            "print(bf16.bf16_choice(torch.device('cpu'), 'bf16', shape=bf16.probe_shape(4096, 256, 512))[0])")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert out.returncode == 0 and out.stdout.strip() == "fp32", out.stdout + out.stderr
