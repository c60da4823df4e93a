"""train.engine=deepspeed against the native engine on configs/test.yaml, 2 gloo ranks.

One spawn of 2 ranks runs, one after the other:
  A  native engine, ep=2 (the reference curve);
  B  DeepSpeed ZeRO-1, ep=2;
  C  DeepSpeed ZeRO-2, ep=1 (experts replicated, reduced by DeepSpeed over 2 ranks), from a user
     ds_config JSON (small buckets, no overlap), checkpoint every 3 steps;
  D  DeepSpeed ZeRO-2 resumed from C's step-3 checkpoint;
  E  the native engine (ep=2) resumed from the same DeepSpeed checkpoint.
Every curve (loss and gradient norm per step) must be the native one. The config checks run
without DeepSpeed.
"""
from __future__ import annotations

import json
import os

import pytest

from moe_dist.config import ConfigError, load_config
from moe_dist.train.engines.deepspeed import build_ds_config, deepspeed_available

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 5
RTOL = 2e-4  # same math, different reduction order


def _config(tmp: str, name: str, *extra: str):
    return load_config(os.path.join(ROOT, "configs/test.yaml"), [
        f"run.dir={tmp}/{name}", f"data.cache_dir={tmp}/cache", f"data.corpus={ROOT}/tests/data/python-docs",
        f"train.steps={STEPS}", "run.progress=false", "run.plots=false", "run.tensorboard=false", "eval.max_sequences=8",
        *extra])


def _curve(run_dir: str) -> list[tuple[int, float, float]]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"], r["grad_norm"]) for r in map(json.loads, f) if r.get("loss") is not None]


def _engines(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist

    from moe_dist.train.loop.trainer import train

    ds_json = os.path.join(tmp, "ds_config.json")
    if rank == 0:
        with open(ds_json, "w") as f:
            json.dump({"zero_optimization": {"stage": 2, "reduce_bucket_size": 20000, "allgather_bucket_size": 20000,
                                             "overlap_comm": False},
                       "gradient_clipping": 1.0}, f)
    dist.barrier()
    runs = {
        "A": ["parallel.ep=2"],
        "B": ["parallel.ep=2", "train.engine=deepspeed", "deepspeed.zero_stage=1"],
        "C": ["parallel.ep=1", "train.engine=deepspeed", f"deepspeed.config={ds_json}", "ckpt.every=3"],
        "D": ["parallel.ep=1", "train.engine=deepspeed", f"deepspeed.config={ds_json}",
              f"resume={tmp}/C/checkpoints/step_000003"],
        "E": ["parallel.ep=2", f"resume={tmp}/C/checkpoints/step_000003"],
    }
    out = {}
    for name, extra in runs.items():
        summary = train(_config(tmp, name, *extra))
        out[name] = {"val_loss": summary["val_loss"], "curve": _curve(f"{tmp}/{name}") if rank == 0 else None}
        if rank == 0:
            with open(f"{tmp}/{name}/run.json", encoding="utf-8") as f:
                out[name]["dense"] = json.load(f)["dense"]
    return out


@pytest.mark.slow
def test_deepspeed_zero1_zero2_match_native_and_resume(tmp_path):
    ok, why = deepspeed_available()
    if not ok:
        pytest.skip(f"DeepSpeed is not importable ({why}): install the deepspeed extra (scripts/setup.sh with "
                    "EXTRAS=dev,deepspeed)")
    from helpers.dist_harness import run_ranks

    res = run_ranks(_engines, 2, args=(str(tmp_path),), timeout=600)[0]
    ref = res["A"]["curve"]
    assert [res[n]["dense"] for n in "ABCDE"] == ["fsdp", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero2", "fsdp"]
    assert [s for s, _, _ in ref] == list(range(1, STEPS + 1))
    assert ref[-1][1] < ref[0][1]  # it trains
    for name in ("B", "C"):
        curve = res[name]["curve"]
        assert [s for s, _, _ in curve] == [s for s, _, _ in ref], name
        for (step, loss, norm), (_, ref_loss, ref_norm) in zip(curve, ref):
            assert loss == pytest.approx(ref_loss, rel=RTOL), (name, step, loss, ref_loss)
            assert norm == pytest.approx(ref_norm, rel=RTOL), (name, step, norm, ref_norm)
        assert res[name]["val_loss"] == pytest.approx(res["A"]["val_loss"], rel=RTOL), name
        worst = max(max(abs(l / rl - 1), abs(n / rn - 1)) for (_, l, n), (_, rl, rn) in zip(curve, ref))
        print(f"\n{name} vs native: losses {[round(l, 5) for _, l, _ in curve]}, largest relative difference {worst:.1e}")
    for name in ("D", "E"):  # resumed at step 3 from the DeepSpeed run's checkpoint, in a new run directory
        tail = res[name]["curve"]
        assert [s for s, _, _ in tail] == [4, 5], name
        for (step, loss, norm), (_, ref_loss, ref_norm) in zip(tail, ref[3:]):
            assert loss == pytest.approx(ref_loss, rel=RTOL), (name, step, loss, ref_loss)
            assert norm == pytest.approx(ref_norm, rel=RTOL), (name, step, norm, ref_norm)
        assert res[name]["val_loss"] == pytest.approx(res["A"]["val_loss"], rel=RTOL), name


# ---- the ds_config checks (no DeepSpeed needed) ------------------------------------------------------------
def _cfg(tmp_path, *extra):
    return load_config(os.path.join(ROOT, "configs/test.yaml"), list(extra))


def _json(tmp_path, obj) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(obj))
    return str(path)


def test_ds_config_fills_in_our_settings(tmp_path):
    cfg = _cfg(tmp_path, "train.global_batch=8", "train.grad_accum=2", "train.grad_clip=0.5")
    ds = build_ds_config(cfg, world_size=2)
    assert ds["train_micro_batch_size_per_gpu"] == 2 and ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 8 and ds["gradient_clipping"] == 0.5
    assert ds["zero_optimization"] == {"stage": 2, "reduce_scatter": True, "contiguous_gradients": True}
    # the user's JSON wins where it speaks, deepspeed.zero_stage wins over the JSON
    path = _json(tmp_path, {"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}, "gradient_clipping": 2.0,
                            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}})
    ds = build_ds_config(_cfg(tmp_path, f"deepspeed.config={path}"), world_size=2)
    assert ds["zero_optimization"]["stage"] == 1 and ds["zero_optimization"]["reduce_bucket_size"] == 1000
    assert ds["gradient_clipping"] == 2.0 and ds["optimizer"]["type"] == "AdamW"
    ds = build_ds_config(_cfg(tmp_path, f"deepspeed.config={path}", "deepspeed.zero_stage=2"), world_size=2)
    assert ds["zero_optimization"]["stage"] == 2


@pytest.mark.parametrize("user, words", [
    ({"zero_optimization": {"stage": 3}}, ["zero_optimization.stage", "allowed: 1, 2"]),
    ({"zero_optimization": {"stage": 0}}, ["zero_optimization.stage", "allowed: 1, 2"]),
    ({"fp16": {"enabled": True}}, ["'fp16'", "train.dtype=bf16"]),
    ({"bf16": {"enabled": True}}, ["'bf16'", "train.dtype=bf16"]),
    ({"scheduler": {"type": "WarmupLR"}}, ["'scheduler'", "train.lr"]),
    ({"train_batch_size": 64}, ["train_batch_size=64", "train.global_batch"]),
    ({"gradient_accumulation_steps": 4}, ["gradient_accumulation_steps=4", "train.grad_accum"]),
    ({"zero_optimization": {"stage": 2, "reduce_scatter": False}}, ["reduce_scatter", "allowed: true"]),
])
def test_ds_config_refusals_name_the_key(tmp_path, user, words):
    cfg = _cfg(tmp_path, f"deepspeed.config={_json(tmp_path, user)}")
    with pytest.raises(ConfigError) as e:
        build_ds_config(cfg, world_size=2)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_ds_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="deepspeed.config: cannot read"):
        build_ds_config(_cfg(tmp_path, f"deepspeed.config={tmp_path}/missing.json"), world_size=1)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="deepspeed.config: .* is not valid JSON"):
        build_ds_config(_cfg(tmp_path, f"deepspeed.config={bad}"), world_size=1)
    with pytest.raises(ConfigError, match=r"train.engine='ds' is not allowed; allowed: \['native', 'deepspeed'\]"):
        _cfg(tmp_path, "train.engine=ds")
    with pytest.raises(ConfigError, match=r"deepspeed.zero_stage: got 3"):
        _cfg(tmp_path, "deepspeed.zero_stage=3")
