"""`moe-dist sweep`: the study file, the grid, the report's arithmetic, and real sweeps of real
training runs (report and figures written, finished runs skipped, a crashed and an interrupted run
resumed from their checkpoints)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from moe_dist.config import ConfigError
from moe_dist.moe.routers import build_router
from moe_dist.moe.routing.types import RoutingContext
from moe_dist.study.report import aggregate, mean_std
from moe_dist.study.spec import check_runs, load_study

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIGURES = {"val_ppl.png", "val_curve.png", "fluctuation.png", "load_balance.png", "throughput.png", "eval_k.png"}


def _study(tmp_path, text: str, name: str = "study.yaml") -> str:
    path = tmp_path / name
    path.write_text(text.replace("OUT", str(tmp_path / "out")))
    return str(path)


def _sweep(study: str, *args: str, **kw):
    return subprocess.run([sys.executable, "-m", "moe_dist.cli", "sweep", "--config", study, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, **kw)


# ---- the study file and the grid ----------------------------------------------------------------
def test_timing_study_is_the_study_shortened():
    """configs/study-timing.yaml times the study's routers on the study's model: the same overrides
    but the run length and evaluation keys, the same router entries (the ramps left out)."""
    study = load_study(os.path.join(ROOT, "configs", "study.yaml"))
    timing = load_study(os.path.join(ROOT, "configs", "study-timing.yaml"))
    length = ("train.steps=", "eval.every=", "ckpt.every=")

    def model_and_data(s):
        return [o for o in s.overrides if not o.startswith(length)]

    assert model_and_data(timing) == model_and_data(study) and timing.base == study.base
    assert set(timing.routers) == set(study.routers) - {"hyper_ramp", "smoe_dropout_ramp"}
    assert all(timing.routers[label] == study.routers[label] for label in timing.routers)
    assert (timing.processes_per_run, timing.threads_per_run) == (study.processes_per_run, study.threads_per_run)


def test_follow_up_study_is_the_study_setting():
    """configs/study-followup.yaml (two candidate causes of negative results) trains what the study
    trains: the same base, overrides and run layout; topk is its reference."""
    study = load_study(os.path.join(ROOT, "configs", "study.yaml"))
    follow = load_study(os.path.join(ROOT, "configs", "study-followup.yaml"))
    assert (follow.base, follow.overrides) == (study.base, study.overrides)
    assert follow.reference == "topk" and follow.routers["topk"] == study.routers["topk"]
    assert (follow.processes_per_run, follow.threads_per_run) == (study.processes_per_run, study.threads_per_run)


def test_study_two_is_the_study_setting():
    """configs/study2.yaml trains the study's model on its data for as long; configs/study2-symphony.yaml
    the same, longer (only the run length and the validation interval differ); every option the
    two files set is one the routers take (the config check of each run)."""
    study = load_study(os.path.join(ROOT, "configs", "study.yaml"))
    two = load_study(os.path.join(ROOT, "configs", "study2.yaml"))
    longer = load_study(os.path.join(ROOT, "configs", "study2-symphony.yaml"))
    assert (two.base, two.overrides) == (study.base, study.overrides)
    length = ("train.steps=", "eval.every=")
    assert [o for o in longer.overrides if not o.startswith(length)] == [o for o in study.overrides if not o.startswith(length)]
    assert "train.steps=3000" in longer.overrides and longer.base == study.base
    for s in (two, longer):
        assert s.reference == "topk" and s.routers["topk"] == study.routers["topk"] and s.seeds == [0, 1, 2]
        assert (s.processes_per_run, s.threads_per_run) == (study.processes_per_run, study.threads_per_run)
        check_runs(s)
    again = load_study(os.path.join(ROOT, "configs", "study2-ac-authors.yaml"))  # ac_authors after its fix
    assert (again.base, again.overrides, again.seeds) == (two.base, two.overrides, two.seeds)
    assert list(again.routers) == ["ac_authors"]
    assert again.routers["ac_authors"].options == two.routers["ac_authors"].options
    check_runs(again)


def test_grid_and_run_overrides(tmp_path):
    path = _study(tmp_path, """
out: OUT
base: configs/test.yaml
overrides: {train.steps: 3, parallel.ep: 1}
seeds: [0, 5]
routers:
  topk: {}
  ssr_small: {router: ssr, options: {p: 0.01}, compare_to: topk}
variants: {a: {}, b: [model.moe.top_k=1]}
runs_at_once: 3
""")
    study = load_study(path)
    assert study.runs_at_once == 3 and study.reference == "topk"
    assert [r.name for r in study.runs] == ["topk-a-s0", "topk-a-s5", "topk-b-s0", "topk-b-s5",
                                            "ssr_small-a-s0", "ssr_small-a-s5", "ssr_small-b-s0", "ssr_small-b-s5"]
    run = study.runs[-1]
    assert run.overrides[:4] == ['train.steps=3', 'parallel.ep=1', 'model.moe.top_k=1', 'model.moe.router="ssr"']
    assert 'model.moe.router_options.p=0.01' in run.overrides and "train.seed=5" in run.overrides
    cfg = check_runs(study)[run.name]
    assert (cfg.model.moe.router, cfg.model.moe.router_options["p"], cfg.model.moe.top_k, cfg.train.seed) == \
        ("ssr", 0.01, 1, 5)
    assert cfg.run.dir == os.path.join(str(tmp_path / "out"), "runs", "ssr_small-b-s5")


@pytest.mark.parametrize("text, expected", [
    ("base: configs/test.yaml\nroutes: {topk: {}}\n", "unknown key(s) ['routes']"),
    ("base: configs/test.yaml\nrouters: {topk: {option: 1}}\n", "routers.topk: unknown key(s) ['option']"),
    ("base: configs/test.yaml\nrouters: {topk: {}}\nseeds: [1, 1]\n", "seeds"),
    ("base: configs/test.yaml\nrouters: {topk: {}}\nreference: ssr\n", "reference: 'ssr' is not a router label"),
    ("base: configs/test.yaml\nrouters: {a: {compare_to: b}}\n", "routers.a.compare_to"),
    ("routers: {topk: {}}\n", "study base: missing"),
    ("base: configs/test.yaml\nrouters: {topk: {}}\nruns_at_once: 0\n", "runs_at_once"),
])
def test_bad_study_file_names_the_key(tmp_path, text, expected):
    with pytest.raises(ConfigError) as e:
        load_study(_study(tmp_path, text))
    assert expected in str(e.value)


def test_bad_run_config_names_run_and_key_once(tmp_path):
    path = _study(tmp_path, "out: OUT\nbase: configs/test.yaml\noverrides: {parallel.ep: 1}\n"
                            "routers: {topk: {}, bad: {router: nosuch}}\n")
    with pytest.raises(ConfigError, match=r"run bad-s0: model.moe.router='nosuch' is not allowed; allowed: \[.*'ac', .*'topk'"):
        check_runs(load_study(path))
    r = _sweep(path)
    assert r.returncode == 2
    assert r.stderr.count("error:") == 1 and "model.moe.router" in r.stderr and "allowed" in r.stderr


# ---- the report's arithmetic ----------------------------------------------------------------------
def _record(router, seed, ppl, time_s, cv=0.1, eval_k=None):
    return {"name": f"{router}-s{seed}", "router": router, "variant": "default", "seed": seed, "status": "done",
            "val_ppl": ppl, "tokens_per_s": 1000 / time_s, "train_time_s": time_s, "cpu_step_s": time_s / 500,
            "parameters": {"active": 10, "total": 20},
            "load": {"load_cv": cv, "max_load_ratio": 1.5, "dead_experts": 0.0},
            "fluctuation": [{"step": 2, "top1": 0.5, "topk": 0.6}, {"step": 4, "top1": 0.1, "topk": 0.2}],
            "eval_k": eval_k or {}}


def test_aggregate_pairs_by_seed(tmp_path):
    path = _study(tmp_path, "out: OUT\nbase: configs/test.yaml\nseeds: [0, 1, 2]\n"
                            "routers: {topk: {}, hyper: {compare_to: smoe_dropout}, smoe_dropout: {}}\n")
    study = load_study(path)
    records = [_record("topk", s, p, 10.0) for s, p in enumerate([100.0, 110.0, 120.0])]
    records += [_record("hyper", s, p, 11.0, eval_k={"1": p + 5, "2": p}) for s, p in enumerate([98.0, 109.0, 121.0])]
    records += [_record("smoe_dropout", s, p, 10.0, eval_k={"1": p + 50, "2": p})
                for s, p in enumerate([99.0, 108.0, 119.0])]
    agg = aggregate(study, records)
    topk = agg["routers"][0]
    assert topk["val_ppl"]["mean"] == pytest.approx(110.0) and topk["val_ppl"]["std"] == pytest.approx(10.0)
    assert topk["fluct_top1_last"]["mean"] == pytest.approx(0.1) and topk["fluct_top1_mean"]["mean"] == pytest.approx(0.3)
    by = {(c["router"], c["against"]): c for c in agg["comparisons"]}
    vs_topk = by[("hyper", "topk")]
    assert vs_topk["val_ppl"]["diff"]["mean"] == pytest.approx((-2 - 1 + 1) / 3)  # paired, not difference of means' std
    assert vs_topk["val_ppl"]["lower"] == 2 and vs_topk["train_time_s"]["ratio"]["mean"] == pytest.approx(1.1)
    assert vs_topk["cpu_step_s"]["ratio"]["mean"] == pytest.approx(1.1)
    declared = by[("hyper", "smoe_dropout")]
    assert declared["declared"] and declared["eval_k"]["1"]["diff"]["mean"] == pytest.approx((-46 - 44 - 43) / 3)
    assert ("topk", "topk") not in by
    assert mean_std([None, 2.0])["n"] == 1 and mean_std([])["mean"] is None


# ---- topk at another inference k (HyperRouter's SMoE baseline) ----------------------------------------
def test_topk_routes_at_eval_k_only_in_eval_mode():
    torch.manual_seed(0)
    router = build_router("topk", 16, 8, 2, eval_k=4)
    x, ctx = torch.randn(5, 16), RoutingContext()
    assert router(x, ctx).expert_ids.shape == (5, 2)
    router.eval()
    r = router(x, ctx)
    assert r.expert_ids.shape == (5, 4) and torch.allclose(r.gates.sum(-1), torch.ones(5))
    assert torch.equal(r.expert_ids, r.logits.topk(4, -1).indices)
    with pytest.raises(ValueError, match="eval_k"):
        build_router("topk", 16, 8, 2, eval_k=9)


# ---- real sweeps ----------------------------------------------------------------------------------
SMOKE = """
out: OUT
base: configs/test.yaml
overrides: {train.steps: 2, parallel.ep: 1, eval.every: 1, run.tensorboard: false}
seeds: [0]
routers:
  topk: {}
  hyper: {compare_to: topk}
eval_k: [1, 2, 4]
runs_at_once: 2
"""


@pytest.mark.slow
def test_sweep_smoke_report_figures_and_skip(tmp_path):
    path = _study(tmp_path, SMOKE)
    out = tmp_path / "out"
    r = _sweep(path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "2 to run" in r.stdout
    report = (out / "report.md").read_text()
    assert "| topk | 1/1 |" in report and "| hyper | 1/1 |" in report and "k=1" in report
    assert FIGURES <= set(os.listdir(out / "figures"))
    data = json.loads((out / "study.json").read_text())
    runs = {x["name"]: x for x in data["runs"]}
    assert set(runs) == {"topk-s0", "hyper-s0"} and all(x["status"] == "done" for x in runs.values())
    for x in runs.values():
        assert x["steps"] == 2 and x["val_ppl"] > 1 and set(x["eval_k"]) == {"1", "2", "4"}
        assert x["eval_k"]["2"] == pytest.approx(x["val_ppl"])  # trained at k=2: the same evaluation
        assert x["fluctuation"] and x["load"]["load_cv"] is not None and x["cpu_step_s"] > 0
    summary = out / "runs" / "topk-s0" / "summary.json"
    stamp = summary.stat().st_mtime_ns
    again = _sweep(path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "2 finished, 0 to run" in again.stdout and "[sweep] start" not in again.stderr
    assert summary.stat().st_mtime_ns == stamp
    # the same directory with other settings is refused, not continued
    other = _study(tmp_path, SMOKE.replace("train.steps: 2", "train.steps: 3"), "other.yaml")
    bad = _sweep(other)
    assert bad.returncode == 2 and "was started with other settings" in bad.stderr


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _wait_for(predicate, proc, timeout=300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_crashed_and_interrupted_runs_resume_from_their_checkpoints(tmp_path):
    path = _study(tmp_path, """
out: OUT
base: configs/test.yaml
overrides: {train.steps: 200, parallel.ep: 1, eval.every: 100, ckpt.every: 50, run.tensorboard: false}
routers: {topk: {}}
""")
    run_dir = tmp_path / "out" / "runs" / "topk-s0"
    metrics, checkpoints = run_dir / "metrics.jsonl", run_dir / "checkpoints"

    def sweep():
        return subprocess.Popen([sys.executable, "-m", "moe_dist.cli", "sweep", "--config", path], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def rows():
        return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []

    # 1. the training process dies (SIGKILL) after its step-50 checkpoint: the run is reported failed
    proc = sweep()
    assert _wait_for(lambda: (checkpoints / "step_000050").is_dir(), proc)
    for child in _children(proc.pid):
        os.kill(child, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "FAILED topk-s0" in err, out[-2000:] + err[-2000:]
    assert not (run_dir / "summary.json").exists()
    # 2. the next sweep resumes it from step 50; stopping that sweep (SIGTERM) checkpoints the run where it is
    log_file = run_dir / "sweep.log"
    proc = sweep()
    # the first run's rows past step 50 are still in metrics.jsonl until the resumed trainer rewrites
    # it: wait for the resume line of this sweep's run, then for rows it wrote itself
    assert _wait_for(lambda: log_file.exists() and "step_000050 at step 50 (" in log_file.read_text(), proc)
    resumed = time.time()
    assert _wait_for(lambda: metrics.stat().st_mtime > resumed and rows()[-1]["step"] > 52, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    assert "interrupted" in err and not (run_dir / "summary.json").exists()
    stopped_at = int(sorted(os.listdir(checkpoints))[-1].split("_")[-1])
    assert 52 < stopped_at < 200
    # 3. and the third finishes it, from there
    r = _sweep(path)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (run_dir / "sweep.log").read_text()
    assert "step_000050 at step 50 (" in log, log[-3000:]
    assert f"at step {stopped_at} (" in log
    assert [row["step"] for row in rows()] == list(range(1, 201))  # each step once: continued, not restarted
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 200
