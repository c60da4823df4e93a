"""Smoke tests of the layer benchmark: it runs tiny cases end to end and prints valid JSON
with the documented keys (no timing assertions: the figures depend on the machine)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.runner import add_ratios
from benchmarks.timing import peak_step_memory
from benchmarks.workload import Sizes, Workload, imbalance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = {"impl", "router", "ep", "procs", "tokens", "dtype", "tokens_per_s", "time_per_token_us", "step_ms",
            "cpu_ms", "step_ms_all", "peak_mem_mib", "page_faults", "malloc", "kernel", "imbalance", "load_avg"}


def _run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.layer", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()], proc.stderr


def test_layer_benchmark_json_one_and_two_processes():
    records, err = _run("--json", "--tokens", "128", "--dtypes", "fp32,bf16", "--ep", "1,2", "--d-model", "32",
                        "--d-ff", "64", "--experts", "4", "--repeats", "2", "--warmup", "1", "--skew", "1.0",
                        "--seq-len", "32", "--threads", "1", "--impls", "moe_dist,floor", "--routers", "topk,xmoe")
    assert records, err
    for r in records:
        missing = REQUIRED - set(r)
        assert not missing, f"missing keys {missing} in {r}"
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and len(r["step_ms_all"]) == 2 and r["peak_mem_mib"] > 0
    impls = {(r["impl"], r["router"], r["ep"], r["procs"], r["dtype"]) for r in records}
    for dtype in ("fp32", "bf16"):
        assert ("moe_dist", "topk", 1, 1, dtype) in impls and ("floor", "-", 1, 1, dtype) in impls
        for router in ("topk", "xmoe"):  # expert parallel and its control on the same two processes
            assert ("moe_dist", router, 2, 2, dtype) in impls and ("moe_dist", router, 1, 2, dtype) in impls
    ours = [r for r in records if r["impl"] == "moe_dist"]
    assert all("time_vs_floor" in r for r in ours if r["procs"] == 1)
    assert all("time_vs_control" in r for r in ours if r["ep"] == 2)
    assert all("time_vs_topk" in r for r in ours if r["router"] == "xmoe")
    assert sum(r.get("fastest_floor", False) for r in records if r["impl"] == "floor") == 2  # one per dtype
    assert "Targets:" in err  # with --json the table and the target check go to stderr


def test_deepspeed_case_or_clear_skip():
    records, err = _run("--json", "--tokens", "64", "--dtypes", "fp32", "--ep", "1", "--d-model", "32", "--d-ff", "64",
                        "--experts", "4", "--repeats", "1", "--warmup", "0", "--impls", "moe_dist,deepspeed",
                        "--no-memory")
    ds = [r for r in records if r["impl"] == "deepspeed"]
    if ds:
        assert "time_vs_deepspeed" in next(r for r in records if r["impl"] == "moe_dist")
    else:
        assert "skipping impl=deepspeed" in err and "pip install" in err


def test_unknown_router_is_refused():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.layer", "--routers", "nope", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "nope" in proc.stderr and "topk" in proc.stderr


def test_skew_makes_routing_unbalanced():
    sizes = Sizes(d_model=64, d_ff=32, num_experts=8, top_k=2)
    dev = torch.device("cpu")
    flat = Workload(sizes, 2048, torch.float32, dev, None, 0.0, 0).routed()[1]
    skewed = Workload(sizes, 2048, torch.float32, dev, None, 1.5, 0).routed()[1]
    assert sum(flat) == sum(skewed) == 4096
    assert imbalance(skewed) > imbalance(flat) + 0.5
    assert skewed[0] == max(skewed)  # expert 0 is the most preferred


def test_peak_memory_counts_the_step_allocations():
    def step():
        a = torch.ones(1 << 20)  # 4 MiB
        b = a * 2  # another 4 MiB live at once
        del a, b

    assert 8 << 20 <= peak_step_memory(step, torch.device("cpu")) < 9 << 20


def test_ratios_are_paired_medians():
    recs = [
        dict(impl="floor", router="-", ep=1, procs=1, kernel="bmm", step_ms=2.0, _times=[2.0, 2.0, 4.0]),
        dict(impl="floor", router="-", ep=1, procs=1, kernel="loop", step_ms=3.0, _times=[3.0, 3.0, 3.0]),
        dict(impl="moe_dist", router="topk", ep=1, procs=1, kernel="loop", step_ms=2.2, _times=[2.2, 2.2, 4.4]),
        dict(impl="deepspeed", router="topk", ep=1, procs=1, kernel="loop", step_ms=4.4, _times=[4.4, 4.4, 8.8]),
    ]
    add_ratios(recs)
    assert recs[0]["fastest_floor"] and not recs[1]["fastest_floor"]
    assert abs(recs[2]["time_vs_floor"] - 1.1) < 1e-9 and recs[2]["floor_kernel"] == "bmm"
    assert abs(recs[2]["time_vs_deepspeed"] - 0.5) < 1e-9


def test_token_graph_routers_with_grouped_query_heads_and_their_targets():
    records, err = _run("--json", "--tokens", "64", "--dtypes", "fp32", "--ep", "1", "--d-model", "32", "--d-ff", "64",
                        "--experts", "4", "--repeats", "1", "--warmup", "0", "--impls", "moe_dist", "--no-memory",
                        "--seq-len", "32", "--heads", "4", "--kv-heads", "2", "--threads", "1",
                        "--routers", "topk,similarity,attention,symphony")
    by_router = {r["router"]: r for r in records}
    assert set(by_router) == {"topk", "similarity", "attention", "symphony"}
    assert by_router["attention"]["heads"] == 4 and by_router["attention"]["kv_heads"] == 2
    for router in ("similarity", "attention", "symphony"):
        assert by_router[router]["time_vs_topk"] > 0
        assert f"{router} time / topk = " in err  # one target line per router case
    assert "heads=4/2" in err


def test_heads_that_do_not_divide_are_refused():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.layer", "--quick", "--heads", "3", "--kv-heads", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--heads 3" in proc.stderr


def test_router_alone_benchmark_reports_each_router_against_topk():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.router", "--json", "--tokens", "128", "--seq-len", "32",
                           "--d-model", "32", "--d-ff", "64", "--experts", "4", "--heads", "4", "--kv-heads", "2",
                           "--router-repeats", "3", "--layer-repeats", "1", "--threads", "1", "--parts"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = {r["router"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert set(records) == {"similarity", "attention", "symphony"}
    for name, r in records.items():
        assert r["router_ms"] > 0 and r["topk_layer_ms"] > 0
        assert abs(r["overhead"] - r["extra_ms"] / r["topk_layer_ms"]) < 1e-9
        assert f"{name}: alone" in proc.stderr
        assert r["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    # --parts: the attention router alone scans entropies; both token-graph routers mix; symphony does neither
    parts = {name: r["parts_ms"] for name, r in records.items()}
    assert parts["attention"]["entropy scan"] > 0 and parts["similarity"]["entropy scan"] == 0
    assert all(parts[name]["mixing forward"] > 0 and parts[name]["mixing backward"] > 0
               for name in ("similarity", "attention"))
    assert not any(parts["symphony"].values())
    assert proc.stderr.count("profiled parts per step:") == 2


def test_training_benchmark_end_to_end(tmp_path):
    """`python -m benchmarks.train`: real training runs of each case, the table and the JSON
    with tokens/s per round, the FLOP count and a matmul peak."""
    from moe_dist.config import load_config
    from moe_dist.model.params import train_flops_per_token

    out = tmp_path / "train.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.train", "--config", "configs/test.yaml", "--nproc", "1",
                           "--steps", "3", "--skip", "1", "--rounds", "1", "--engines", "native", "--dtypes", "fp32",
                           "--json", str(out), "parallel.ep=1", f"data.corpus={ROOT}/tests/data/python-docs",
                           f"data.cache_dir={tmp_path}/cache"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CPU capability" in proc.stdout and "| native | fp32 | off |" in proc.stdout
    res = json.loads(out.read_text())
    (case,) = res["cases"]
    assert case["engine"] == "native" and len(case["tokens_per_s"]) == 1 and case["median"] > 0
    assert 0 < case["mfu"] < 1 and res["peak_flops"]["fp32"] > 1e8
    cfg = load_config(os.path.join(ROOT, "configs/test.yaml"), ["model.vocab_size=512"])
    assert res["flops_per_token"] == train_flops_per_token(cfg.model, cfg.train.seq_len)


@pytest.mark.compile
@pytest.mark.timeout(1800)
def test_training_benchmark_compile_axis_and_step_profile(tmp_path):
    """`--compile off,on`: eager and compiled runs paired in one benchmark, the compile seconds and
    the compiled / eager line; `benchmarks.step_profile`: the paired step times and the op table."""
    out = tmp_path / "train.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    data = [f"data.corpus={ROOT}/tests/data/python-docs", f"data.cache_dir={tmp_path}/cache"]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.train", "--config", "configs/test.yaml", "--nproc", "1",
                           "--steps", "3", "--skip", "1", "--rounds", "1", "--engines", "native", "--dtypes", "fp32",
                           "--compile", "off,on", "--json", str(out), "parallel.ep=1", *data],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = {c["compile"]: c for c in json.loads(out.read_text())["cases"]}
    assert set(cases) == {"off", "on"} and cases["off"]["compile_s"] == [] and cases["on"]["compile_s"][0] > 0
    assert "| native | fp32 | on |" in proc.stdout and "native fp32: compiled / eager per round" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step_profile", "--config", "configs/test.yaml",
                           "--batch", "4", "--rounds", "2", "--profile-steps", "1", "--top", "5", *data],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "eager / compiled per round" in proc.stdout and "| `aten::mm` |" in proc.stdout
    assert proc.stdout.count("\n| `") == 5 and "| all ops |" in proc.stdout


def test_step_profile_fp32_against_bf16_and_the_optimizer_step(tmp_path, capsys):
    """`step_profile --compare dtype`: both dtypes eager, bf16 with the trainer's attention choice;
    `optimizer_step`: foreach and fused AdamW on the same state give the same weights."""
    from benchmarks import optimizer_step, step_profile

    data = [f"data.corpus={ROOT}/tests/data/python-docs", f"data.cache_dir={tmp_path}/cache"]
    assert step_profile.main(["--config", "configs/test.yaml", "--compare", "dtype", "--batch", "2", "--rounds", "2",
                              "--profile-steps", "1", "--top", "4", "train.attention_dtype=fp32", *data]) == 0
    out = capsys.readouterr().out
    assert "bf16: attention runs in fp32 (train.attention_dtype=fp32)" in out
    assert "fp32 / bf16 per round" in out and "| op (self CPU time, ms per step; profiler on) | fp32 | bf16 |" in out
    assert optimizer_step.main(["--config", "configs/test.yaml", "--steps", "2", "--rounds", "2", *data]) == 0
    out = capsys.readouterr().out
    assert out.count("round ") == 2 and "foreach / fused: median" in out


def test_fused_and_foreach_adamw_step_alike():
    from benchmarks.optimizer_step import _with_implementation
    from moe_dist.config import load_config
    from moe_dist.model import build_model
    from moe_dist.train.loop.optim import build_optimizer

    cfg = load_config(os.path.join(ROOT, "configs/test.yaml"), [])
    weights = []
    for fused in (False, True):
        model = build_model(cfg.model, 64, seed=0)
        for i, w in enumerate(model.parameters()):
            w.grad = torch.full_like(w, 1e-3 * (i + 1))
        built = build_optimizer(model, cfg.train)
        assert built.defaults["fused"] is True  # the trainer's choice on a CPU
        opt = _with_implementation(built, fused)
        for _ in range(3):
            opt.step()
        weights.append(torch.cat([w.detach().flatten() for w in model.parameters()]))
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-6, atol=1e-7)


def test_benchmarks_say_when_the_machine_is_not_idle(monkeypatch):
    from benchmarks import timing

    monkeypatch.setattr(timing.os, "getloadavg", lambda: (2.6, 1.0, 1.0))
    assert timing.busy_note(2, "at the start") == (
        "note: load average 2.60 at the start exceeds the 2 process(es) this benchmark runs: another program "
        "competes for the cores; these figures are not from an idle machine")
    assert timing.busy_note(3, "at the end") is None
