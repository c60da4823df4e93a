"""`moe-dist eval --k`: one evaluation per inference k for routers that have one."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "moe_dist.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_eval_at_several_k(tmp_path):
    run_dir = str(tmp_path / "run")
    r = _cli("train", "--config", "configs/test.yaml", "model.moe.router=hyper", "model.moe.router_options.k_max=4",
             f"run.dir={run_dir}", "train.steps=3", "parallel.ep=1")
    assert r.returncode == 0, r.stderr[-2000:]
    r = _cli("eval", "--run-dir", run_dir, "--k", "1,4")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.load(open(os.path.join(run_dir, "eval_k.json")))
    assert [row["k"] for row in rows] == [1, 4]
    assert rows[0]["val_loss"] != rows[1]["val_loss"]  # k changes the model's function
    bad = _cli("eval", "--run-dir", run_dir, "--k", "0,x")
    assert bad.returncode != 0 and "--k" in bad.stderr


def test_eval_k_refused_for_router_without_inference_k(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("model:\n  moe:\n    router: sinkhorn\nparallel:\n  ep: 1\n")
    r = _cli("eval", "--run-dir", str(run_dir), "--k", "1,2")
    assert r.returncode != 0 and "has no inference k" in r.stderr
