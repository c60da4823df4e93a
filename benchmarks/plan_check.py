"""The planner checked against measurement: reduced-depth versions of the two presets
(configs/tinyllama-upcycle-8x2.yaml, configs/phi3-mini-upcycle-4x2.yaml: same width and
vocabulary, fewer blocks, MoE in every other block) train a few real steps with
`moe-dist train --nproc R` at several layouts; each rank's peak resident memory, less the
runtime baseline, is compared with the planner's per-rank total for the same layout,
workload and dtype.

    .venv/bin/python -m benchmarks.plan_check [--work DIR] [--cases NAME ...] [--max-gib 12]

Baseline: for each number of ranks R, R processes started the same way (torch.distributed.run,
same OMP_NUM_THREADS) import the trainer, bring the process group up (one all-reduce so gloo's
buffers exist), load the same prepared data, build nothing, and report their peak RSS. The
trainer's ranks report theirs in summary.json (``peak_rss_gib``, at the end of training).
measured = trainer peak - baseline, per rank; ratio = measured / planned; passes within
--tolerance (default 15%). Cases whose planned memory (all ranks, plus baselines) exceeds
--max-gib, or the memory available now, are skipped. Prints a table with the CPU capability
and writes WORK/plan_check.json. Opt-in: not part of the test suite (minutes, GiBs).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout (benchmarks/ is at its top)
PRESETS = {"tinyllama": os.path.join(ROOT, "configs", "tinyllama-upcycle-8x2.yaml"),
           "phi3": os.path.join(ROOT, "configs", "phi3-mini-upcycle-4x2.yaml")}
# small data: the committed corpus slice and a small tokenizer (model.vocab_size stays the preset's)
DATA = ["data.corpus=" + os.path.join(ROOT, "tests", "data", "python-docs"), "data.vocab_size=512",
        "data.val_fraction=0.2"]
# a few short steps in fp32 (bf16 matmuls are very slow on AVX2-only CPUs), nothing saved or plotted;
# gloo named explicitly (what `auto` picks on a CPU) so that the planner models its reduce-scatter
RUN = ["parallel.backend=gloo", "train.dtype=fp32", "train.steps=2", "train.warmup_steps=1", "eval.every=0", "ckpt.every=0",
       "ckpt.save_final=false", "run.plots=false", "run.progress=false", "run.print_every=1"]
GIB = float(1 << 30)


@dataclass
class Case:
    name: str
    preset: str  # key of PRESETS
    nproc: int
    ep: int
    n_layers: int = 2
    seq_len: int = 64
    global_batch: int = 2
    grad_accum: int = 1
    extra: list[str] = field(default_factory=list)

    def overrides(self, run_dir: str) -> list[str]:
        return DATA + RUN + [f"model.n_layers={self.n_layers}", "model.moe.layers=every_other",
                             f"train.seq_len={self.seq_len}", f"train.global_batch={self.global_batch}",
                             f"train.grad_accum={self.grad_accum}", f"eval.max_sequences={self.nproc}",
                             f"eval.batch={self.nproc}", f"parallel.ep={self.ep}", f"run.dir={run_dir}", *self.extra]


CASES = [
    Case("tinyllama-2L-1proc", "tinyllama", nproc=1, ep=1),
    Case("tinyllama-2L-2rank-ep2", "tinyllama", nproc=2, ep=2),
    # experts FSDP-sharded over edp=2; 4 experts instead of 8 so that the whole layer's experts unit, gathered
    # and reduce-scattered in fp32 over gloo, keeps the two ranks under 12 GiB (8 experts: about 16 GiB)
    Case("tinyllama-2L-4exp-2rank-ep1-edp2", "tinyllama", nproc=2, ep=1, extra=["model.moe.num_experts=4"]),
    Case("tinyllama-2L-4exp-2rank-ep1-edp2-accum2", "tinyllama", nproc=2, ep=1, global_batch=4, grad_accum=2,
         extra=["model.moe.num_experts=4"]),
    Case("tinyllama-2L-2rank-ep1-edp2", "tinyllama", nproc=2, ep=1),  # about 16 GiB: skipped under the default
    Case("phi3-2L-1proc", "phi3", nproc=1, ep=1),
    Case("phi3-2L-2rank-ep2", "phi3", nproc=2, ep=2),  # about 13 GiB in all: skipped under the default --max-gib
]


# ---- the planner's figure ---------------------------------------------------------------------
def planned(case: Case, run_dir: str) -> dict:
    """The planner's per-rank memory for this case's layout and workload (its functions, called directly)."""
    from moe_dist.model.params import count_params
    from moe_dist.plan.plan_input import load_plan_input
    from moe_dist.plan.planner import evaluate_layout

    inp = load_plan_input(PRESETS[case.preset], case.overrides(run_dir))
    counts = count_params(inp.model, inp.moe_blocks)
    micro_batch = case.global_batch // case.grad_accum // case.nproc
    layout = evaluate_layout(inp, counts, case.nproc, case.nproc, case.ep, micro_batch)
    return {"params_total": counts["total"], "memory_gib": layout["memory_gib"]}


# ---- measurement ------------------------------------------------------------------------------
def _env(nproc: int) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))  # as `moe-dist --nproc` sets it
    return env


def _call(cmd: list[str], log: str, nproc: int) -> None:
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=_env(nproc))
    print(f"  ({time.perf_counter() - t0:.0f} s, log {log})", flush=True)
    if code:
        sys.exit(f"plan check: command failed with exit code {code}; see {log}")


def baseline_probe(out: str, config: str, overrides: list[str]) -> None:
    """One rank of the baseline: everything the trainer does before it builds a model."""
    import torch
    import torch.distributed as dist

    from moe_dist.config import load_config
    from moe_dist.train.setup.data import load_data
    from moe_dist.train.setup.runtime import gather_peak_rss, setup_runtime

    cfg = load_config(config, overrides)
    rt = setup_runtime(cfg)
    if rt.distributed:
        dist.all_reduce(torch.ones(1024), group=rt.groups.dp)
    load_data(cfg, rt, lambda _msg: None)
    peaks = gather_peak_rss(rt)
    if rt.is_main:
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"peak_rss_bytes": peaks}, f)
    if rt.distributed:
        dist.destroy_process_group()


def measure_baseline(case: Case, work: str) -> list[int]:
    out = os.path.join(work, f"baseline-{case.nproc}.json")
    if not os.path.exists(out):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
               f"--nproc-per-node={case.nproc}", "-m", "benchmarks.plan_check", "--baseline-probe", out,
               "--config", PRESETS[case.preset], "--", *case.overrides(os.path.join(work, "baseline"))]
        _call(cmd, os.path.join(work, f"baseline-{case.nproc}.log"), case.nproc)
    with open(out, encoding="utf-8") as f:
        return json.load(f)["peak_rss_bytes"]


def measure_training(case: Case, work: str) -> list[float]:
    run_dir = os.path.join(work, case.name)
    summary = os.path.join(run_dir, "summary.json")
    if not os.path.exists(summary):
        cmd = [os.path.join(os.path.dirname(sys.executable), "moe-dist"), "train", "--config", PRESETS[case.preset],
               "--nproc", str(case.nproc), *case.overrides(run_dir)]
        _call(cmd, os.path.join(work, f"{case.name}.log"), case.nproc)
    with open(summary, encoding="utf-8") as f:
        peaks = json.load(f).get("peak_rss_gib")
    if not peaks:
        sys.exit(f"plan check: {summary} has no peak_rss_gib (a trainer from before per-rank peak memory was recorded)")
    return [g * GIB for g in peaks]


def available_bytes() -> float:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return float("inf")


def prepare_data_cache() -> None:
    from moe_dist.config import load_config
    from moe_dist.data import prepare_data

    prepare_data(load_config(PRESETS["tinyllama"], DATA).data, log=lambda _msg: None)


# ---- the check --------------------------------------------------------------------------------
def check_case(case: Case, work: str, max_gib: float, tolerance: float) -> dict:
    plan = planned(case, os.path.join(work, case.name))
    per_rank = plan["memory_gib"]["total"]
    base = measure_baseline(case, work)
    need = (per_rank * GIB + max(base)) * case.nproc
    row = {"case": case.name, "preset": os.path.basename(PRESETS[case.preset]), "n_layers": case.n_layers,
           "nproc": case.nproc, "ep": case.ep, "edp": case.nproc // case.ep, "seq_len": case.seq_len,
           "global_batch": case.global_batch, "grad_accum": case.grad_accum, "params": plan["params_total"],
           "planned_gib": plan["memory_gib"], "baseline_gib": [round(b / GIB, 3) for b in base]}
    if need > max_gib * GIB or need > available_bytes() - GIB:
        print(f"skip {case.name}: needs about {need / GIB:.1f} GiB (--max-gib {max_gib:g}, "
              f"{available_bytes() / GIB:.1f} GiB available now)", flush=True)
        return dict(row, skipped=True)
    peaks = measure_training(case, work)
    net = [p - b for p, b in zip(peaks, base)]
    ratios = [n / (per_rank * GIB) for n in net]
    return dict(row, skipped=False, peak_gib=[round(p / GIB, 3) for p in peaks],
                measured_gib=[round(n / GIB, 3) for n in net], ratio=[round(r, 3) for r in ratios],
                within_tolerance=all(abs(r - 1) <= tolerance for r in ratios))


def format_table(rows: list[dict], capability: str) -> str:
    lines = [f"CPU capability {capability}; {platform.processor() or platform.machine()}; fp32; "
             "planned = the planner's per-rank total; measured = peak RSS - baseline",
             f"{'case':38s} {'params':>7s} {'R':>2s} {'ep':>3s} {'edp':>3s} {'base':>6s} {'peak':>7s} "
             f"{'measured':>9s} {'planned':>8s} {'ratio':>6s}"]
    for r in rows:
        head = f"{r['case']:38s} {r['params'] / 1e6:6.0f}M {r['nproc']:>2d} {r['ep']:>3d} {r['edp']:>3d}"
        if r["skipped"]:
            lines.append(f"{head}  skipped (memory)")
            continue
        for rank, (b, p, m, q) in enumerate(zip(r["baseline_gib"], r["peak_gib"], r["measured_gib"], r["ratio"])):
            label = head if rank == 0 else f"{'  rank ' + str(rank):38s} {'':>7s} {'':>2s} {'':>3s} {'':>3s}"
            lines.append(f"{label} {b:6.2f} {p:7.2f} {m:9.2f} {r['planned_gib']['total']:8.2f} {q:6.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=os.path.join(ROOT, "runs", "plan-check"), help="runs and results (reused)")
    parser.add_argument("--cases", nargs="*", default=None, metavar="NAME",
                        help="run only these cases: " + ", ".join(c.name for c in CASES))
    parser.add_argument("--max-gib", type=float, default=12.0, help="skip cases planned above this, all ranks together")
    parser.add_argument("--tolerance", type=float, default=0.15, help="allowed |measured / planned - 1| (default 0.15)")
    parser.add_argument("--baseline-probe", metavar="OUT", help=argparse.SUPPRESS)  # one rank of the baseline
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.baseline_probe:
        baseline_probe(args.baseline_probe, args.config, args.overrides)
        return 0
    import torch

    known = {c.name: c for c in CASES}
    unknown = [n for n in args.cases or [] if n not in known]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; allowed: {', '.join(known)}")
    cases = [known[n] for n in args.cases] if args.cases else CASES
    os.makedirs(args.work, exist_ok=True)
    prepare_data_cache()  # here, so that no measured process trains the tokenizer
    rows = [check_case(c, args.work, args.max_gib, args.tolerance) for c in cases]
    capability = torch.backends.cpu.get_cpu_capability()
    print(format_table(rows, capability))
    result = {"cpu_capability": capability, "cpu": platform.processor() or platform.machine(),
              "torch": torch.__version__, "tolerance": args.tolerance, "cases": rows}
    out = os.path.join(args.work, "plan_check.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    measured = [r for r in rows if not r["skipped"]]
    ok = bool(measured) and all(r["within_tolerance"] for r in measured)
    print(f"{'pass' if ok else 'FAIL'}: {sum(r['within_tolerance'] for r in measured)} of {len(measured)} measured "
          f"cases within {args.tolerance:.0%}; results in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
