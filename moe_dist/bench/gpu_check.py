"""The first run on a GPU: what the device is, whether the MoE layer and every router compute on it
what they compute on the CPU, the main job and a model that loads a GPU (tokens/s, MFU, peak memory),
peak memory against the dry run's, host synchronisations per step, the expert kernels against the floor.

    python -m moe_dist.bench.gpu_check --out DIR [--device cuda|cpu] [--quick] [--budget-s 450]
                                       [--sections device,tests,...] [--work DIR]

Sections (:data:`SECTIONS`), each in a process of its own with its own time limit (shares of
``--budget-s`` that finished sections hand on), a failed or timed-out section reported with its
last lines while the others still run:

- ``device``: torch, CUDA, the GPU, CPUs; a measured bf16 matmul rate beside the datasheet's;
- ``tests``: ``tests/test_device_layer.py`` on the device (every router's layer against the CPU);
- ``train``: ``moe-dist train`` of the main job (configs/tiny.yaml, one process) and of a 2-block
  slice of configs/tinyllama-upcycle-8x2.yaml at sequence length 2048, bf16: tokens/s, MFU, peak memory;
- ``memory_vs_dry_run``: that slice's peak allocated memory against ``moe-dist plan --dry-run``'s;
- ``host_syncs``: CUDA synchronisations and device-to-host copies per training step (profiler);
- ``layer_bench``: ``python -m moe_dist.bench.layer``, each expert kernel against the floor.

``DIR`` receives at most four files: ``gpu_check.json`` (every section: status ok / failed /
skipped, seconds, figures, the error's last lines), ``gpu_check.md`` (a short summary), ``sections.log``
(what the sections printed) and, from ``scripts/gpu_check.sh``, ``gpu_check.log``; the runs
themselves go to ``--work``. The JSON and the summary are rewritten after every section, so a run
stopped from outside keeps what it finished. ``--device cpu`` runs everything on the CPU at small
sizes (the check's own test).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN_CONFIG = os.path.join(ROOT, "configs", "tiny.yaml")
BIG_CONFIG = os.path.join(ROOT, "configs", "tinyllama-upcycle-8x2.yaml")
CORPUS = os.path.join(ROOT, "tests", "data", "python-docs")
DEVICE_TESTS = ["tests/test_device_layer.py"]  # the test files that take MOE_DIST_TEST_DEVICE

SECTIONS = ("device", "tests", "train", "memory_vs_dry_run", "host_syncs", "layer_bench")
# seconds each section is planned to take on one GPU; the budget is shared in these proportions
PLANNED_S = {"device": 30, "tests": 90, "train": 120, "memory_vs_dry_run": 50, "host_syncs": 45, "layer_bench": 90}
MIN_SECTION_S = 5  # a section given less than this is skipped, not started
INJECT_ENV = "MOE_DIST_GPU_CHECK_INJECT"  # test hook: "section=fail,other=hang"
WORK_ENTRIES = ("results", "train", "host_syncs", "layer_bench", "tests")  # what a run rewrites in --work


# ---- sizes: a GPU, the CPU, the CPU in --quick ------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    matmul_n: int
    main_overrides: tuple  # on top of configs/tiny.yaml
    main_steps: int
    big_overrides: Optional[tuple]  # on top of the TinyLlama slice; None: no big run
    big_steps: int
    skip_steps: int  # first steps left out of tokens/s (warm-up)
    sync_warmup: int
    sync_steps: int
    bench_args: tuple


# the TinyLlama preset cut to 2 blocks (block 1 an MoE block), a few sequences of 2048 tokens per
# step, the committed corpus with a small tokenizer (model.vocab_size stays the preset's 32000)
BIG_SLICE = ("model.n_layers=2", "model.moe.layers=every_other", "train.seq_len=2048", "train.global_batch=8",
             "train.grad_accum=1", "data.vocab_size=512", "eval.max_sequences=8", "eval.batch=8")
CPU_SMALL_MODEL = ("model.d_model=128", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=256",
                   "model.vocab_size=1024", "train.seq_len=64", "train.global_batch=2", "eval.max_sequences=2",
                   "eval.batch=2")
CPU_MAIN = ("model.n_layers=2", "train.seq_len=64", "train.global_batch=4", "data.vocab_size=512",
            "eval.max_sequences=4", "eval.batch=4")


def sizes_for(device: str, quick: bool) -> Sizes:
    if device == "cpu":
        return Sizes(matmul_n=512 if quick else 1024, main_overrides=CPU_MAIN, main_steps=4 if quick else 8,
                     big_overrides=None if quick else BIG_SLICE + CPU_SMALL_MODEL, big_steps=4, skip_steps=1,
                     sync_warmup=1, sync_steps=2,
                     bench_args=("--tokens", "512" if quick else "1024", "--d-model", "128", "--d-ff", "256",
                                 "--repeats", "2" if quick else "3", "--warmup", "1"))
    return Sizes(matmul_n=8192, main_overrides=("eval.max_sequences=24", "eval.batch=12"),
                 main_steps=12 if quick else 40, big_overrides=BIG_SLICE, big_steps=6 if quick else 15,
                 skip_steps=3, sync_warmup=2, sync_steps=3,
                 bench_args=("--tokens", "16384" if quick else "16384,65536", "--repeats", "3" if quick else "5",
                             "--warmup", "2"))


def train_dtype(device: str) -> str:
    """bf16 on a GPU; fp32 on the CPU (bf16 matmuls are slow on CPUs without AVX-512 bf16 / AMX)."""
    return "fp32" if device == "cpu" else "bf16"


def common_overrides(device: str, work: str) -> list[str]:
    """One process, the committed corpus, nothing saved, plotted or evaluated along the way."""
    return ["parallel.ep=1", f"run.device={device}", f"train.dtype={train_dtype(device)}", f"data.corpus={CORPUS}",
            f"data.cache_dir={os.path.join(work, 'data_cache')}", "data.val_fraction=0.2", "train.warmup_steps=2",
            "eval.every=0", "eval.probe_every=0", "ckpt.every=0", "ckpt.save_final=false", "run.plots=false",
            "run.tensorboard=false", "run.progress=false", "run.print_every=5"]


# ---- what a section sees -----------------------------------------------------------------------------
class Skip(Exception):
    """The section cannot run here (said why); reported as skipped, not failed."""


class SectionFailed(Exception):
    """The section ran and its check failed; ``figures`` are still reported."""

    def __init__(self, message: str, figures: dict):
        super().__init__(message)
        self.figures = figures


@dataclass
class Context:
    name: str
    device: str
    quick: bool
    out: str
    work: str
    deadline: float  # time.monotonic() by which the section must be done
    figures: dict = field(default_factory=dict)

    @property
    def sizes(self) -> Sizes:
        return sizes_for(self.device, self.quick)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def path(self, *parts: str) -> str:
        """A file under --work (its directory made)."""
        p = os.path.join(self.work, *parts)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        return p

    def fresh_dir(self, *parts: str) -> str:
        """A run directory under --work, removed if a previous run left it (the trainer makes it again)."""
        d = os.path.join(self.work, *parts)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        return d

    def partial(self, **figures) -> None:
        """Figures so far, written at once: a section stopped by its time limit keeps them."""
        self.figures.update(figures)
        write_json(result_path(self.work, self.name), {"status": "running", "figures": self.figures})


def result_path(work: str, name: str) -> str:
    return os.path.join(work, "results", f"{name}.json")


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def child_env(extra: Optional[dict] = None) -> dict:
    """This environment with the repository importable (whether or not the package is installed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop(INJECT_ENV, None)  # the hook acts on this check's sections, not on what they start
    env["PYTHONUNBUFFERED"] = "1"  # a process stopped at its time limit has printed all it had
    env.update(extra or {})
    return env


def run_command(cmd: list[str], timeout_s: float, stdout=None, env: Optional[dict] = None) -> int:
    """Run ``cmd`` from the repository root, printing into this section's log; its exit code."""
    print("$ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=ROOT, env=env or child_env(), stdout=stdout, stderr=subprocess.STDOUT
                          if stdout is None else None, timeout=max(1.0, timeout_s))
    return done.returncode


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def check_device(device: str) -> None:
    """A clear one-line error when the device cannot be used here."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device cuda: torch {torch.__version__} sees no CUDA device (torch.version.cuda="
                           f"{torch.version.cuda}); use --device cpu to run this check on the CPU")
    if device not in ("cuda", "cpu"):
        raise RuntimeError(f"--device {device!r}; allowed: cuda, cpu")


# ---- a. device -----------------------------------------------------------------------------------------
def cpu_has_fast_bf16() -> bool:
    """AVX2-only CPUs run bf16 matmuls many times slower than fp32: time bf16 there only with AVX-512."""
    import torch

    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def matmul_tflops(device: str, n: int, dtype, per_timing: int = 5, timings: int = 7) -> float:
    """Median rate of an n x n x n matmul after a warm-up, ``per_timing`` matmuls per timed interval."""
    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    rates = []
    for _ in range(timings):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(per_timing):
            a @ b
        sync(device)
        rates.append(2.0 * n ** 3 * per_timing / (time.perf_counter() - t0) / 1e12)
    return round(statistics.median(rates), 2)


def nvidia_smi() -> Optional[str]:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def section_device(ctx: Context) -> dict:
    import platform

    import torch

    check_device(ctx.device)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count()
    figs = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "cpu_cores_usable": cores,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if ctx.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        figs.update(gpu=p.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=round(p.total_memory / 2**30, 2),
                    compute_capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    multiprocessors=p.multi_processor_count, nvidia_smi=nvidia_smi())
    from ..hardware import datasheet_tflops

    figs["datasheet_bf16_tflops"] = datasheet_tflops(figs.get("gpu"))
    # the rate MFU is taken against: the training's dtype (bf16 on a GPU, fp32 on the CPU)
    dtype = torch.float32 if train_dtype(ctx.device) == "fp32" else torch.bfloat16
    n = ctx.sizes.matmul_n
    ctx.partial(**figs)
    figs.update(matmul_n=n, matmul_dtype=str(dtype).replace("torch.", ""), matmul_tflops=matmul_tflops(ctx.device, n, dtype))
    if ctx.device == "cpu" and cpu_has_fast_bf16():
        figs["matmul_bf16_tflops"] = matmul_tflops(ctx.device, n, torch.bfloat16)
    if figs["datasheet_bf16_tflops"]:
        figs["matmul_of_datasheet"] = round(figs["matmul_tflops"] / figs["datasheet_bf16_tflops"], 3)
    print(f"device: {figs.get('gpu', 'CPU ' + figs['cpu_capability'])}, torch {figs['torch']} (CUDA {figs['cuda']}); "
          f"{n}^3 {figs['matmul_dtype']} matmul {figs['matmul_tflops']} TFLOP/s (datasheet {figs['datasheet_bf16_tflops']})")
    return figs


# ---- b. tests --------------------------------------------------------------------------------------------
def junit_counts(path: str) -> dict:
    """Counts and failed test ids of a pytest JUnit XML file."""
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            message = (bad.get("message") or "").strip().splitlines()
            failed.append(f"{case.get('name')}: {message[0][:300] if message else ''}")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"passed": passed, "failed": counts["failures"] + counts["errors"], "skipped": counts["skipped"],
            "failed_tests": failed}


def section_tests(ctx: Context) -> dict:
    import importlib.util

    check_device(ctx.device)
    xml = ctx.path("tests", "junit.xml")
    if os.path.exists(xml):
        os.remove(xml)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *DEVICE_TESTS]
    if importlib.util.find_spec("pytest_timeout") is None:  # pytest.ini's --timeout needs it
        cmd[4:4] = ["-o", "addopts=-ra"]
    else:  # a hanging test fails alone (and the report is written) instead of the section's time running out
        cmd.append("--timeout=60")
    rc = run_command(cmd, ctx.left_s() - 3, env=child_env({"MOE_DIST_TEST_DEVICE": ctx.device}))
    if not os.path.exists(xml):
        raise RuntimeError(f"pytest exited with {rc} and wrote no report (collection or start-up failed; see above)")
    figs = dict(junit_counts(xml), files=DEVICE_TESTS, pytest_exit_code=rc)
    if figs["passed"] == 0 or figs["failed"] or rc != 0:
        raise SectionFailed(f"{figs['failed']} failed, {figs['passed']} passed, {figs['skipped']} skipped "
                            f"(pytest exit {rc})", figs)
    return figs


# ---- c. train --------------------------------------------------------------------------------------------
def read_run(run_dir: str, skip_steps: int) -> dict:
    """tokens/s of the steps after the first ``skip_steps`` (median per step, and over all of them
    together), and what summary.json says of memory and loss."""
    from ..train.observe.metrics import read_metrics

    rows = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "tokens_per_s" in r and "step" in r]
    if not rows:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has no training step")
    kept = rows[min(skip_steps, len(rows) - 1):]
    step_tokens = rows[1]["tokens"] - rows[0]["tokens"] if len(rows) > 1 else rows[0]["tokens"]
    seconds = sum(step_tokens / r["tokens_per_s"] for r in kept)
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        summary = json.load(f)
    return {"steps": len(rows), "steps_timed": len(kept), "tokens_per_step": step_tokens,
            "tokens_per_s_median": round(statistics.median(r["tokens_per_s"] for r in kept), 1),
            "tokens_per_s_overall": round(len(kept) * step_tokens / seconds, 1),
            "step_ms_median": round(1000 * statistics.median(step_tokens / r["tokens_per_s"] for r in kept), 2),
            "first_step_s": round(step_tokens / rows[0]["tokens_per_s"], 3),
            "loss_first": round(rows[0]["loss"], 4), "loss_last": round(rows[-1]["loss"], 4),
            "val_loss": summary.get("val_loss"), "train_seconds": summary.get("train_seconds"),
            "parameters": summary.get("parameters"),
            "cuda_peak_allocated_gib": summary.get("cuda_peak_allocated_gib"),
            "cuda_peak_reserved_gib": summary.get("cuda_peak_reserved_gib"),
            "cuda_peak_allocated_gib_per_step_max": max((r.get("cuda_peak_allocated_gib") or 0) for r in rows) or None,
            "peak_rss_gib": summary.get("peak_rss_gib")}


def train_flops_per_token(config_yaml: str) -> float:
    """Training FLOPs of one token (:func:`moe_dist.model.params.train_flops_per_token`)."""
    from ..model.params import train_flops_per_token as per_token
    from ..plan.plan_input import load_plan_input

    inp = load_plan_input(config_yaml)
    return per_token(inp.model, inp.seq_len, inp.moe_blocks)


def significant(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def mfu(flops_per_token: float, tokens_per_s: float, device_figs: dict) -> dict:
    """Model FLOPs utilisation against the measured matmul rate, the planner's default rate
    (``moe-dist plan --compute-tflops``) and the datasheet's."""
    from ..plan.planner import DEFAULT_COMPUTE_TFLOPS

    achieved = flops_per_token * tokens_per_s / 1e12
    out = {"model_tflops": significant(achieved), "train_flops_per_token": flops_per_token,
           "planner_default_tflops": DEFAULT_COMPUTE_TFLOPS}
    for key, peak in (("mfu_vs_measured_matmul", device_figs.get("matmul_tflops")),
                      ("mfu_vs_planner_default", DEFAULT_COMPUTE_TFLOPS),
                      ("mfu_vs_datasheet", device_figs.get("datasheet_bf16_tflops"))):
        out[key] = significant(achieved / peak) if peak else None
    return out


def train_run(ctx: Context, name: str, config: str, overrides: tuple, steps: int) -> dict:
    """``moe-dist train --nproc 1`` of one case into WORK/train/NAME; its figures."""
    run_dir = ctx.fresh_dir("train", name)
    cmd = [sys.executable, "-m", "moe_dist.cli", "train", "--config", config, "--nproc", "1",
           *common_overrides(ctx.device, ctx.work), *overrides, f"train.steps={steps}", f"run.dir={run_dir}"]
    t0 = time.monotonic()
    rc = run_command(cmd, ctx.left_s() - 2)
    if rc:
        raise RuntimeError(f"train {name}: moe-dist train exited with {rc} (its output is above)")
    figs = read_run(run_dir, ctx.sizes.skip_steps)
    figs.update(mfu(train_flops_per_token(os.path.join(run_dir, "config.yaml")), figs["tokens_per_s_median"],
                    (read_json(result_path(ctx.work, "device")) or {}).get("figures", {})))
    figs.update(wall_s=round(time.monotonic() - t0, 1), command=" ".join(cmd[2:]), run_dir=run_dir)
    print(f"train {name}: {figs['tokens_per_s_median']:.0f} tokens/s (median of {figs['steps_timed']} steps), "
          f"MFU {figs['mfu_vs_measured_matmul']} of the measured matmul, {figs['mfu_vs_planner_default']} of "
          f"{figs['planner_default_tflops']:g} TFLOP/s; peak allocated {figs['cuda_peak_allocated_gib']} GiB", flush=True)
    return figs


BIG_NAME = "tinyllama_2L"
BIG_RUN_S = {"cuda": 45.0, "cpu": 20.0}  # start the TinyLlama slice only with this much time left


def section_train(ctx: Context) -> dict:
    check_device(ctx.device)
    sz = ctx.sizes
    ctx.partial(main_job=train_run(ctx, "main_job", MAIN_CONFIG, sz.main_overrides, sz.main_steps))
    if sz.big_overrides is None:
        ctx.partial(**{BIG_NAME: "skipped (--quick on the CPU)"})
    elif ctx.left_s() < BIG_RUN_S[ctx.device]:
        raise SectionFailed(f"{ctx.left_s():.0f} s left, too little for the {BIG_NAME} run", ctx.figures)
    else:
        ctx.partial(**{BIG_NAME: train_run(ctx, BIG_NAME, BIG_CONFIG, sz.big_overrides, sz.big_steps)})
    return ctx.figures


# ---- e. peak memory against the dry run -------------------------------------------------------------------
def model_overrides(overrides) -> list[str]:
    """The overrides that shape the model and its step (what the dry run reads), not where it writes."""
    return [o for o in overrides if o.split("=", 1)[0].split(".")[0] in ("model", "train", "parallel", "data")
            and not o.startswith(("data.cache_dir", "train.steps"))]


def section_memory_vs_dry_run(ctx: Context) -> dict:
    check_device(ctx.device)
    try:
        from ..plan.dry_run import dry_run
    except (ImportError, AttributeError) as e:
        raise Skip(f"dry run not available: {type(e).__name__}: {e}")
    sz = ctx.sizes
    overrides = (*common_overrides(ctx.device, ctx.work), *(sz.big_overrides or BIG_SLICE + CPU_SMALL_MODEL))
    trained = (read_json(result_path(ctx.work, "train")) or {}).get("figures", {}).get(BIG_NAME)
    if isinstance(trained, dict) and os.path.exists(os.path.join(trained["run_dir"], "summary.json")):
        real = trained
        print(f"the real run: the train section's {BIG_NAME} run ({trained['run_dir']})", flush=True)
    else:
        real = train_run(ctx, BIG_NAME, BIG_CONFIG, sz.big_overrides or BIG_SLICE + CPU_SMALL_MODEL, 3)
    # the whole run's peak (summary.json: the final validation included) and the training steps' own
    # (the metrics rows' counter after each step): the dry run plays training steps only
    ctx.partial(real_cuda_peak_allocated_gib=real["cuda_peak_allocated_gib"],
                real_training_peak_allocated_gib=real["cuda_peak_allocated_gib_per_step_max"],
                real_cuda_peak_reserved_gib=real["cuda_peak_reserved_gib"], real_peak_rss_gib=real["peak_rss_gib"])
    shared = model_overrides(overrides)
    t0 = time.monotonic()
    result = dry_run(BIG_CONFIG, shared, nodes=1, gpus_per_node=1, steps=2)
    planner = result.get("planner") or _planner_memory(result)
    gib = 2.0 ** 30
    dry = result["peak_bytes"] / gib
    planned = ((planner or {}).get("memory_gib") or {}).get("total")
    real_gib = real["cuda_peak_allocated_gib_per_step_max"] or real["cuda_peak_allocated_gib"]
    figs = {"dry_run_peak_gib": round(dry, 3), "dry_run_seconds": round(time.monotonic() - t0, 1),
            "dry_run_categories_gib": {k: round(v / gib, 3) for k, v in result["categories_bytes"].items()},
            "planner_memory_gib": (planner or {}).get("memory_gib"), "planner_total_gib": planned,
            "real_over_dry_run": round(real_gib / dry, 3) if real_gib and dry else None,
            "real_over_planner": round(real_gib / planned, 3) if real_gib and planned else None,
            "overrides": shared}
    if ctx.device == "cpu":
        figs["note"] = "on the CPU there is no allocated-memory counter: only the dry run's and the planner's figures"
    ctx.partial(**figs)
    print(f"memory: real peak allocated in training {real_gib} GiB (whole run {real['cuda_peak_allocated_gib']} GiB), "
          f"dry run {dry:.3f} GiB, planner {planned} GiB", flush=True)
    return ctx.figures


def _planner_memory(result: dict) -> Optional[dict]:
    """The planner's memory of the dry run's layout (``result["planner"]`` when the dry run has none)."""
    try:
        from ..plan.dry_run_report import with_planner
    except (ImportError, AttributeError):
        return None
    return with_planner(result).get("planner")


# ---- f. host synchronisations per step ------------------------------------------------------------------
RUNTIME_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                 "cudaMemcpyAsync")
CPU_READS = ("aten::_local_scalar_dense", "aten::item")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def _where(event) -> str:
    """The innermost moe_dist source line above a profiler event. With ``with_stack`` the profiler
    records Python calls as events of their own (named ``path(line): function``) or, in other torch
    versions, as an op's ``stack``: both are looked at, from the event up through its parents."""
    e, hops = event, 0
    while e is not None and hops < 200:
        for frame in [e.name, *(getattr(e, "stack", None) or [])]:
            if "moe_dist/" in frame and "gpu_check" not in frame:
                return "moe_dist/" + frame.split("moe_dist/", 1)[-1]
        e, hops = getattr(e, "cpu_parent", None), hops + 1
    return "unknown"


def count_host_syncs(events) -> tuple[dict, dict]:
    """Counts of the CUDA runtime calls, device copies and scalar reads among profiler events, and
    where (moe_dist source line) the synchronising calls and device-to-host copies come from."""
    counts = dict.fromkeys(RUNTIME_CALLS + ("Memcpy DtoH", "Memcpy HtoD", "Memcpy DtoD") + CPU_READS
                           + ("device scalar reads", "kernel launches"), 0)
    where: dict[str, int] = {}
    for e in events:
        name = e.name
        if name in counts:
            counts[name] += 1
        for kind in ("Memcpy DtoH", "Memcpy HtoD", "Memcpy DtoD"):
            if name.startswith(kind):
                counts[kind] += 1
        if name.startswith(("cudaLaunch", "cuLaunch")):
            counts["kernel launches"] += 1
        if name == "aten::_local_scalar_dense" and _has_child(e, "cudaMemcpyAsync"):
            counts["device scalar reads"] += 1
        if name in SYNC_CALLS or name == "aten::_local_scalar_dense":
            key = f"{name} <- {_where(e)}"
            where[key] = where.get(key, 0) + 1
    return counts, dict(sorted(where.items(), key=lambda kv: -kv[1]))


def _has_child(event, name: str, depth: int = 6) -> bool:
    if depth == 0:
        return False
    return any(c.name == name or _has_child(c, name, depth - 1) for c in getattr(event, "cpu_children", None) or [])


def profiled_steps(trainer, steps: int, device: str, with_stack: bool):
    """The profiler's events of ``steps`` training steps (CPU ops, and CUDA runtime calls and device
    activity on a GPU; with ``with_stack`` the Python calls that led to them)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, with_stack=with_stack) as prof:
        for _ in range(steps):
            trainer.train_step()
        sync(device)
    return prof.events()


def section_host_syncs(ctx: Context) -> dict:
    import torch

    from ..config import load_config
    from ..train.loop.trainer import Trainer

    check_device(ctx.device)
    sz = ctx.sizes
    run_dir = ctx.fresh_dir("host_syncs", "run")
    cfg = load_config(MAIN_CONFIG, [*common_overrides(ctx.device, ctx.work), *sz.main_overrides, f"run.dir={run_dir}",
                                    "train.steps=1000"])
    trainer = Trainer(cfg)
    try:
        for _ in range(sz.sync_warmup):  # first-call work (allocator growth, cuBLAS handles) is not the steady state
            trainer.train_step()
        sync(ctx.device)
        try:
            events = profiled_steps(trainer, sz.sync_steps, ctx.device, with_stack=True)
        except Exception as e:  # the Python tracer is the fragile part: count without source lines then
            print(f"profiling with Python stacks failed ({type(e).__name__}: {e}); profiling without them", flush=True)
            events = profiled_steps(trainer, sz.sync_steps, ctx.device, with_stack=False)
        counts, where = count_host_syncs(events)
        if counts["cudaDeviceSynchronize"]:  # the profile's last call, this check's own sync(), is not the step's
            counts["cudaDeviceSynchronize"] -= 1
        layers, micro = len(trainer.moe), cfg.train.grad_accum
    finally:
        trainer.close()
    steps = sz.sync_steps
    expected = layers * micro + 2
    per_step = {k: round(v / steps, 2) for k, v in counts.items()}
    figs = {"steps_profiled": steps, "totals": counts, "per_step": per_step, "moe_layers": layers,
            "micro_batches": micro, "expected_reads_per_step": expected,
            "expected": (f"{layers} MoE layers x {micro} micro-batch(es) = {layers * micro} dispatch reads (split sizes) "
                         "+ 1 read of the step's losses + 1 of the gradient norm (Trainer.train_step, "
                         "tests/test_host_sync.py)"),
            "sites_total": dict(list(where.items())[:16]), "torch": torch.__version__}
    if ctx.device == "cuda" and not counts["kernel launches"]:  # CUPTI gave nothing: zero syncs would be a lie
        raise SectionFailed("the profiler recorded no CUDA runtime calls (no cudaLaunchKernel): CUPTI unavailable?", figs)
    if ctx.device == "cuda":
        figs["dtoh_copies_per_step"] = per_step["Memcpy DtoH"]
        figs["stream_syncs_per_step"] = per_step["cudaStreamSynchronize"]
        figs["matches_expected"] = per_step["Memcpy DtoH"] == expected and per_step["cudaStreamSynchronize"] <= expected
    else:
        figs["note"] = "CPU: no CUDA events; the scalar reads (aten::_local_scalar_dense) include host-only ones"
    print(f"host syncs per step: DtoH copies {per_step['Memcpy DtoH']}, cudaStreamSynchronize "
          f"{per_step['cudaStreamSynchronize']}, _local_scalar_dense {per_step['aten::_local_scalar_dense']}; "
          f"expected {expected}", flush=True)
    return figs


# ---- d. layer benchmark ------------------------------------------------------------------------------------
KERNELS = ("auto", "loop", "bmm", "grouped_mm")


def bench_cmd(ctx: Context, kernels: str) -> list[str]:
    """The layer benchmark at ep=1, moe_dist against the floor, bf16 on a GPU (fp32 on the CPU)."""
    dtype = "fp32" if ctx.device == "cpu" else "bf16"
    return [sys.executable, "-m", "moe_dist.bench.layer", "--device", ctx.device, "--dtypes", dtype, "--ep", "1",
            "--impls", "moe_dist,floor", "--expert-kernel", kernels, *ctx.sizes.bench_args, "--json"]


def run_bench(ctx: Context, kernels: str) -> tuple[list[dict], Optional[str]]:
    """The rows one benchmark run printed (a run stopped half way keeps its finished cases), and
    its error (None: it ran to the end)."""
    path = ctx.path("layer_bench", f"{kernels.replace(',', '+')}.jsonl")
    with open(path, "w", encoding="utf-8") as out:  # stdout: one JSON object per case; the log: stderr
        try:
            rc = run_command(bench_cmd(ctx, kernels), ctx.left_s() - 5, stdout=out)
            error = None if rc == 0 else f"exit {rc} (see above)"
        except subprocess.TimeoutExpired as e:
            error = f"timed out after {e.timeout:.0f} s"
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    pass
    return rows, error


def bench_table(rows: list[dict]) -> list[dict]:
    """One short row per (tokens, implementation, kernel)."""
    keep = ("impl", "tokens", "dtype", "expert_kernel", "kernel", "step_ms", "tokens_per_s", "time_vs_floor",
            "floor_kernel", "peak_mem_mib")
    return [{k: (round(r[k], 3) if isinstance(r.get(k), float) else r.get(k)) for k in keep if k in r} for r in rows]


def section_layer_bench(ctx: Context) -> dict:
    check_device(ctx.device)
    rows, error = run_bench(ctx, ",".join(KERNELS))
    errors = {"all kernels": error} if error else {}
    if error:  # one kernel failing stops its cases: each kernel without rows runs by itself, while time lasts
        for kernel in [k for k in KERNELS if not any(r.get("expert_kernel") == k for r in rows)]:
            if ctx.left_s() < 20:
                errors[kernel] = "not run: no time left"
                continue
            got, errors[kernel] = run_bench(ctx, kernel)
            rows += [r for r in got if r.get("impl") == "moe_dist" or not any(q.get("impl") == "floor" for q in rows)]
    table = bench_table(rows)
    figs = {"rows": table, "command": " ".join(bench_cmd(ctx, ",".join(KERNELS))[2:]),
            "errors": {k: v for k, v in errors.items() if v}}
    ctx.partial(**figs)
    for r in table:
        if r.get("impl") == "moe_dist":
            print(f"layer {r.get('tokens')} tokens {r.get('dtype')} kernel {r.get('expert_kernel')} -> {r.get('kernel')}: "
                  f"{r.get('step_ms')} ms, x floor {r.get('time_vs_floor')}", flush=True)
    if not any(r.get("impl") == "moe_dist" for r in table):
        raise SectionFailed("the layer benchmark produced no moe_dist row", figs)
    if figs["errors"]:
        raise SectionFailed("; ".join(f"{k}: {v}" for k, v in figs["errors"].items()), figs)
    return figs


SECTION_FUNCS: dict[str, Callable[[Context], dict]] = {
    "device": section_device, "tests": section_tests, "train": section_train,
    "memory_vs_dry_run": section_memory_vs_dry_run, "host_syncs": section_host_syncs, "layer_bench": section_layer_bench}


# ---- one section, in its own process -------------------------------------------------------------------
def injected(name: str) -> Optional[str]:
    """What the test hook asks of this section: ``fail``, ``hang`` or None."""
    for item in os.environ.get(INJECT_ENV, "").split(","):
        key, _, what = item.partition("=")
        if key.strip() == name:
            return what.strip()
    return None


def run_section(name: str, args) -> int:
    """Run one section in this process; its result goes to WORK/results/NAME.json. 0: ok or skipped."""
    ctx = Context(name, args.device, args.quick, args.out, args.work, time.monotonic() + args.limit_s)
    path = result_path(args.work, name)
    try:
        what = injected(name)
        if what == "fail":
            raise RuntimeError(f"failure injected by {INJECT_ENV}")
        if what == "hang":
            time.sleep(3600)
        payload, rc = {"status": "ok", "figures": SECTION_FUNCS[name](ctx)}, 0
    except Skip as e:
        payload, rc = {"status": "skipped", "reason": str(e), "figures": ctx.figures}, 0
    except SectionFailed as e:
        payload, rc = {"status": "failed", "error": str(e), "figures": {**ctx.figures, **e.figures}}, 1
    except Exception as e:  # reported with its traceback in the log; the other sections still run
        traceback.print_exc()
        payload, rc = {"status": "failed", "error": f"{type(e).__name__}: {e}", "figures": ctx.figures}, 1
    write_json(path, payload)
    return rc


# ---- the whole check ------------------------------------------------------------------------------------
class Interrupted(Exception):
    """SIGTERM / SIGINT: stop the running section, keep what is done."""


def _on_signal(signum, frame):
    raise Interrupted(f"signal {signum}")


def section_limit(name: str, left_s: float, pending: list[str]) -> float:
    """This section's share of the time left, in proportion to the planned times of the sections still to run."""
    return left_s * PLANNED_S[name] / sum(PLANNED_S[n] for n in pending)


def _stop_group(proc: subprocess.Popen) -> None:
    """End the section's process group: the section and whatever it started (pytest, a benchmark,
    ``moe-dist train``'s launcher, whose ranks die with it). SIGKILL, not SIGTERM: a trainer
    answers SIGTERM by saving a checkpoint first, time this check does not have."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _log_tail(log_path: str, offset: int, lines: int = 30) -> list[str]:
    with open(log_path, "rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", "replace")
    return text.splitlines()[-lines:]


def run_section_process(name: str, limit_s: float, args, log_path: str) -> dict:
    """One section as a child process with ``limit_s`` seconds; its entry for gpu_check.json."""
    path = result_path(args.work, name)
    if os.path.exists(path):
        os.remove(path)
    cmd = [sys.executable, "-m", "moe_dist.bench.gpu_check", "--section", name, "--out", args.out, "--work", args.work,
           "--device", args.device, "--limit-s", f"{limit_s:.1f}"] + (["--quick"] if args.quick else [])
    t0 = time.monotonic()
    with open(log_path, "ab") as log:
        offset = log.tell()
        log.write(f"\n===== {name} (limit {limit_s:.0f} s) =====\n".encode())
        log.flush()
        env = child_env()
        if os.environ.get(INJECT_ENV):
            env[INJECT_ENV] = os.environ[INJECT_ENV]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc, why = proc.wait(timeout=limit_s), None
        except subprocess.TimeoutExpired:
            rc, why = None, f"timed out after {limit_s:.0f} s (its limit in this run's budget)"
        except BaseException:
            _stop_group(proc)
            raise
        _stop_group(proc)  # after a timeout; after an exit: anything it left running
    seconds = round(time.monotonic() - t0, 1)
    payload = read_json(path) or {}
    status = payload.get("status") if rc in (0, 1) and payload.get("status") in ("ok", "failed", "skipped") else "failed"
    entry = {"status": status, "seconds": seconds, "limit_s": round(limit_s, 1), "figures": payload.get("figures", {})}
    if status == "skipped":
        entry["reason"] = payload.get("reason")
    if status == "failed":
        entry["error"] = why or payload.get("error") or f"the section's process exited with {rc} and wrote no result"
        entry["log_tail"] = _log_tail(log_path, offset)
    return entry


def write_report(out: str, report: dict) -> None:
    write_json(os.path.join(out, "gpu_check.json"), report)
    with open(os.path.join(out, "gpu_check.md"), "w", encoding="utf-8") as f:
        f.write(summary_markdown(report))


def _fmt(v, nd: int = 3) -> str:
    if isinstance(v, float):
        return f"{v:.{nd}g}" if abs(v) < 1000 else f"{v:,.0f}"
    return "-" if v is None else str(v)


def section_lines(name: str, figs: dict) -> list[str]:
    """The figures a reader wants first, per section (none when it has none)."""
    f = figs or {}
    if not f:
        return []
    if name == "device":
        return [f"{f.get('gpu') or 'CPU ' + str(f.get('cpu_capability'))}; torch {f.get('torch')}, CUDA {f.get('cuda')}, "
                f"{f.get('cpu_count')} CPUs; {f.get('matmul_n')}^3 {f.get('matmul_dtype')} matmul "
                f"{_fmt(f.get('matmul_tflops'))} TFLOP/s (datasheet {_fmt(f.get('datasheet_bf16_tflops'))})"]
    if name == "tests":
        lines = [f"{f.get('passed')} passed, {f.get('failed')} failed, {f.get('skipped')} skipped "
                 f"({', '.join(f.get('files', []))})"]
        return lines + [f"  FAILED {t}" for t in f.get("failed_tests", [])[:20]]
    if name == "train":
        lines = []
        for case in ("main_job", BIG_NAME):
            r = f.get(case)
            if isinstance(r, dict):
                lines.append(f"{case}: {_fmt(r.get('tokens_per_s_median'))} tokens/s, "
                             f"step {_fmt(r.get('step_ms_median'))} ms, "
                             f"MFU {_fmt(r.get('mfu_vs_measured_matmul'))} of the measured matmul / "
                             f"{_fmt(r.get('mfu_vs_planner_default'))} of {_fmt(r.get('planner_default_tflops'))} TFLOP/s, "
                             f"peak allocated {_fmt(r.get('cuda_peak_allocated_gib'))} GiB, loss "
                             f"{_fmt(r.get('loss_first'))} -> {_fmt(r.get('loss_last'))}")
            elif r is not None:
                lines.append(f"{case}: {r}")
        return lines
    if name == "memory_vs_dry_run":
        return [f"real peak allocated {_fmt(f.get('real_training_peak_allocated_gib'))} GiB in training "
                f"({_fmt(f.get('real_cuda_peak_allocated_gib'))} GiB whole run), dry run "
                f"{_fmt(f.get('dry_run_peak_gib'))} GiB (real / dry run {_fmt(f.get('real_over_dry_run'))}), planner "
                f"{_fmt(f.get('planner_total_gib'))} GiB (real / planner {_fmt(f.get('real_over_planner'))})"]
    if name == "host_syncs":
        p = f.get("per_step", {})
        return [f"per step: Memcpy DtoH {_fmt(p.get('Memcpy DtoH'))}, cudaStreamSynchronize "
                f"{_fmt(p.get('cudaStreamSynchronize'))}, "
                f"aten::_local_scalar_dense {_fmt(p.get('aten::_local_scalar_dense'))}, "
                f"aten::item {_fmt(p.get('aten::item'))}; expected {f.get('expected_reads_per_step')} reads "
                f"({f.get('moe_layers')} MoE layers x {f.get('micro_batches')} + 2)"
                + ("" if "matches_expected" not in f else f"; as expected: {f['matches_expected']}")]
    if name == "layer_bench":
        return [f"{r.get('tokens')} tokens {r.get('dtype')} {r.get('expert_kernel')} -> {r.get('kernel')}: "
                f"{_fmt(r.get('step_ms'))} ms, x floor {_fmt(r.get('time_vs_floor'))}"
                for r in f.get("rows", []) if r.get("impl") == "moe_dist"]
    return []


def summary_markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# GPU check ({meta['device']}{', quick' if meta['quick'] else ''})", "",
             f"{meta['python']} · budget {meta['budget_s']:.0f} s · {meta.get('total_s', '-')} s in all", "",
             "| section | status | seconds | limit |", "|---|---|---|---|"]
    for name, e in report["sections"].items():
        lines.append(f"| {name} | {e['status']} | {e.get('seconds', '-')} | {e.get('limit_s', '-')} |")
    for name, e in report["sections"].items():
        lines += ["", f"## {name}: {e['status']}"]
        lines += [f"- {l}" for l in section_lines(name, e.get("figures"))]
        if e.get("reason"):
            lines.append(f"- skipped: {e['reason']}")
        if e.get("error"):
            lines.append(f"- error: {str(e['error']).splitlines()[0][:500]}")
    return "\n".join(lines) + "\n"


def prepare_work(work: str) -> None:
    """A fresh work directory for this run's results (the data cache is kept: it is keyed by its inputs)."""
    os.makedirs(work, exist_ok=True)
    for entry in WORK_ENTRIES:
        shutil.rmtree(os.path.join(work, entry), ignore_errors=True)


def run_all(args) -> int:
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        print(f"gpu_check: --sections {args.sections!r}: unknown {unknown}; allowed: {','.join(SECTIONS)}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    prepare_work(args.work)
    log_path = os.path.join(args.out, "sections.log")
    open(log_path, "w").close()
    start = time.monotonic()
    report = {"meta": {"device": args.device, "quick": args.quick, "budget_s": args.budget_s, "sections": names,
                       "python": sys.executable, "work": args.work, "started": time.strftime("%Y-%m-%d %H:%M:%S")},
              "sections": {n: {"status": "pending"} for n in names}}
    print(f"gpu_check: {len(names)} section(s) on {args.device}, budget {args.budget_s:.0f} s; results in {args.out}, "
          f"runs in {args.work}", flush=True)
    signal.signal(signal.SIGTERM, _on_signal)
    write_report(args.out, report)
    try:
        for i, name in enumerate(names):
            left = args.budget_s - (time.monotonic() - start)
            limit = min(left, section_limit(name, left, names[i:]))
            if limit < MIN_SECTION_S:
                report["sections"][name] = {"status": "skipped", "reason": f"{left:.0f} s of the budget left"}
            else:
                print(f"[{time.monotonic() - start:5.0f} s] {name}: started, limit {limit:.0f} s", flush=True)
                report["sections"][name] = run_section_process(name, limit, args, log_path)
            e = report["sections"][name]
            print(f"[{time.monotonic() - start:5.0f} s] {name}: {e['status']}"
                  + (f" in {e['seconds']} s" if "seconds" in e else "")
                  + (f" - {str(e.get('error') or e.get('reason')).splitlines()[0][:300]}" if e['status'] != "ok" else ""),
                  flush=True)
            for line in section_lines(name, e.get("figures")):
                print(f"    {line}", flush=True)
            report["meta"]["total_s"] = round(time.monotonic() - start, 1)
            write_report(args.out, report)
    except (Interrupted, KeyboardInterrupt) as e:
        for name, entry in report["sections"].items():
            if entry["status"] == "pending":
                entry.update(status="skipped", reason=f"the check was stopped ({e or 'interrupt'})")
        report["meta"]["total_s"] = round(time.monotonic() - start, 1)
        write_report(args.out, report)
        print(f"gpu_check: stopped ({e or 'interrupt'}); what finished is in {args.out}", flush=True)
        return 0
    print("\n" + summary_markdown(report), flush=True)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m moe_dist.bench.gpu_check",
                                description="The first run on a GPU: the device, the layer and routers against the CPU, "
                                "training (tokens/s, MFU, memory), memory against the dry run, host syncs per step, "
                                "the expert kernels against the floor (see the module's docstring).")
    p.add_argument("--out", required=True, help="gpu_check.json, gpu_check.md, sections.log")
    p.add_argument("--work", default=None, help="the runs, caches and per-section results (default: "
                   "runs/gpu-check-work in the repository)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: small sizes (this check's own test)")
    p.add_argument("--quick", action="store_true", help="fewer steps and smaller cases (on the CPU: no TinyLlama slice)")
    p.add_argument("--budget-s", type=float, default=450.0, help="seconds for all sections together")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated, run in this order: {','.join(SECTIONS)}")
    p.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)  # internal: run one section in this process
    p.add_argument("--limit-s", type=float, default=600.0, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.budget_s <= 0:
        parser().error(f"--budget-s {args.budget_s:g}: allowed: a number of seconds > 0")
    args.out = os.path.abspath(args.out)
    args.work = os.path.abspath(args.work or os.path.join(ROOT, "runs", "gpu-check-work"))
    if args.section:
        return run_section(args.section, args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
