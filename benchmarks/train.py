"""End-to-end training throughput: engines, dtypes and compilation on the same model and batches, in one run.

    python -m benchmarks.train [--config configs/tiny.yaml] [--nproc 2] [--steps 30]
        [--engines native,deepspeed] [--dtypes fp32,bf16] [--compile off,on] [--rounds 2] [--json FILE]
        [KEY=VALUE ...]

Each round trains every (engine, dtype, compile) case once with ``moe-dist train`` (real processes,
the given config and overrides, ``train.steps=--steps``, no validation or checkpoint until the
end), in an order rotated each round so machine load hits the cases alike. A case's figure is
the median tokens/s of its steps after ``--skip`` warm-up steps (``metrics.jsonl``), its median
over the rounds. ``--compile on`` runs with ``train.compile=true``, every round's compiled runs
sharing one inductor cache (the first round compiles cold, later ones read the cache); the
compile seconds of each run (its ``summary.json``) are printed beside its tokens/s, and the
warm-up steps left out of the median hold the compilation.

Model FLOPs utilisation: training FLOPs per token ``6 N + 12 L d S`` (N the parameters one
token uses, the tied embedding counted once as the output projection; L layers, d the model
width, S the sequence length: attention scores and values, forward and backward) times tokens/s,
over this machine's measured matmul peak for the dtype (a square matmul using as many threads
as the run's processes together, measured before and after the runs; the larger counts).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import torch

from moe_dist.config import load_config
from moe_dist.hardware import matmul_peak
from moe_dist.tuning.bf16 import slow_bf16_note
from .gpu_check.train import train_flops_per_token
from .timing import say_if_busy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


COMPILE = {"off": "false", "on": "true"}


def run_case(config: str, nproc: int, steps: int, engine: str, dtype: str, overrides: list[str], run_dir: str,
             log_file, compile: str = "off", compile_cache: Optional[str] = None) -> dict:
    """One training run; its per-step tokens/s, parameter counts and compile report."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cache = [f"train.compile_cache_dir={compile_cache}"] if compile_cache and compile == "on" else []
    cmd = [sys.executable, "-m", "moe_dist.cli", "train", "--config", config, "--nproc", str(nproc),
           f"run.dir={run_dir}", f"train.steps={steps}", f"train.engine={engine}", f"train.dtype={dtype}",
           f"train.compile={COMPILE[compile]}", *cache,
           "train.bf16_on_slow_cpu=bf16",  # a case measures the dtype it names (main() says when bf16 is slow here)
           "eval.every=0", "eval.max_sequences=8", "ckpt.save_final=false", "run.plots=false", "run.tensorboard=false",
           "run.progress=false", *overrides]
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    if rc != 0:
        log_file.flush()
        tail = open(log_file.name, encoding="utf-8", errors="replace").read().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(cmd)} exited with {rc}; its last lines:\n" + "\n".join(tail))
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8")]
    steps_tps = {r["step"]: r["tokens_per_s"] for r in rows if "tokens_per_s" in r and "step" in r}
    info = json.load(open(os.path.join(run_dir, "run.json"), encoding="utf-8"))
    summary = json.load(open(os.path.join(run_dir, "summary.json"), encoding="utf-8"))
    return {"tokens_per_s": steps_tps, "parameters": info["parameters"], "wall_s": wall,
            "compile": summary.get("compile"), "flops_per_token": train_flops_per_token(os.path.join(run_dir, "config.yaml"))}


def _parse(argv: Optional[list[str]]) -> tuple[argparse.Namespace, list[str], list[str], list[str]]:
    """The arguments, and the engines, dtypes and compile settings they list (each checked)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    p.add_argument("--engines", default="native,deepspeed")
    p.add_argument("--dtypes", default="fp32")
    p.add_argument("--compile", default="off", help="off, on, or off,on (train.compile=false / true)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides for every case")
    args = p.parse_args(argv)
    engines, dtypes, compiles = args.engines.split(","), args.dtypes.split(","), args.compile.split(",")
    for c in compiles:
        if c not in COMPILE:
            p.error(f"--compile: {c!r} is not allowed; allowed: {list(COMPILE)}")
    for d in dtypes:
        if d not in DTYPES:
            p.error(f"--dtypes: {d!r} is not allowed; allowed: {list(DTYPES)}")
    for e in engines:
        if e not in ("native", "deepspeed"):
            p.error(f"--engines: {e!r} is not allowed; allowed: ['native', 'deepspeed']")
    if args.steps <= args.skip:
        p.error(f"--steps {args.steps} must exceed --skip {args.skip}")
    return args, engines, dtypes, compiles


def main(argv: Optional[list[str]] = None) -> int:
    args, engines, dtypes, compiles = _parse(argv)
    cfg = load_config(args.config, list(args.overrides))
    threads_per_proc = cfg.run.threads or max(1, (len(os.sched_getaffinity(0)) // args.nproc))
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"machine: torch {torch.__version__}, CPU capability {cpu}, {os.cpu_count()} cores; "
          f"{args.nproc} processes x {threads_per_proc} thread(s)", flush=True)
    slow = slow_bf16_note(torch.device("cpu"), "bf16" if "bf16" in dtypes else "fp32")
    if slow:
        print(slow, flush=True)
    say_if_busy(args.nproc, "at the start")
    threads = args.nproc * threads_per_proc
    peaks = {d: matmul_peak(DTYPES[d], threads) for d in dtypes}  # measured again at the end: the larger counts
    cases = [(e, d, c) for d in dtypes for e in engines for c in compiles]
    results = {c: [] for c in cases}
    compile_s = {c: [] for c in cases}
    params, fpt = None, None
    work = tempfile.mkdtemp(prefix="moe-dist-bench-train-")
    with open(os.path.join(work, "runs.log"), "w", encoding="utf-8") as log_file:
        for r in range(args.rounds):
            order = cases[r % len(cases):] + cases[:r % len(cases)]
            for case in order:
                engine, dtype, comp = case
                out = run_case(args.config, args.nproc, args.steps, engine, dtype, list(args.overrides),
                               os.path.join(work, f"{engine}-{dtype}-{comp}"), log_file, comp,
                               os.path.join(work, "compile_cache"))
                tps = [v for s, v in sorted(out["tokens_per_s"].items()) if s > args.skip]
                results[case].append(statistics.median(tps))
                if out["compile"]:
                    compile_s[case].append(out["compile"]["seconds"])
                params, fpt = out["parameters"], out["flops_per_token"]
                compiled = (f"; compiled in {out['compile']['seconds']:.1f} s, {out['compile']['graphs']} graph(s)"
                            if out["compile"] else "")
                print(f"round {r + 1}: {engine:9s} {dtype} compile {comp:3s}: {results[case][-1]:,.0f} tokens/s "
                      f"(median of steps {args.skip + 1}-{args.steps}; {out['wall_s']:.0f} s in all{compiled})",
                      flush=True)
    for d in dtypes:  # a peak taken while the machine was busy would inflate the utilisation
        again = matmul_peak(DTYPES[d], threads)
        print(f"matmul peak {d}: {peaks[d] / 1e9:.1f} GFLOP/s at the start, {again / 1e9:.1f} at the end "
              f"(2048^3 matmul on {threads} threads); the larger is used", flush=True)
        peaks[d] = max(peaks[d], again)
    base = statistics.median(results[cases[0]])
    print(f"\n{params['active']:,} active of {params['total']:,} parameters; {fpt / 1e6:.1f} MFLOP per token "
          f"(model FLOPs of training, moe_dist.model.params.train_flops_per_token)\n")
    print("| engine | dtype | compile | tokens/s per round | median | x first case | MFU | compile s per round |")
    print("|---|---|---|---|---|---|---|---|")
    table = []
    for case in cases:
        engine, dtype, comp = case
        runs = results[case]
        med = statistics.median(runs)
        mfu = med * fpt / peaks[dtype]
        table.append({"engine": engine, "dtype": dtype, "compile": comp, "tokens_per_s": runs, "median": med,
                      "mfu": mfu, "compile_s": compile_s[case]})
        secs = " / ".join(f"{v:.1f}" for v in compile_s[case]) or "-"
        print(f"| {engine} | {dtype} | {comp} | {' / '.join(f'{v:,.0f}' for v in runs)} | {med:,.0f} | "
              f"{med / base:.3f} | {100 * mfu:.1f}% | {secs} |")
    for engine, dtype in dict.fromkeys((e, d) for e, d, _ in cases):  # compiled / eager, round by round
        off, on = results.get((engine, dtype, "off")), results.get((engine, dtype, "on"))
        if off and on:
            ratios = [b / a for a, b in zip(off, on)]
            print(f"{engine} {dtype}: compiled / eager per round {' / '.join(f'{v:.3f}' for v in ratios)}, "
                  f"median {statistics.median(ratios):.3f}")
    say_if_busy(args.nproc, "at the end")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"cpu_capability": cpu, "nproc": args.nproc, "threads_per_proc": threads_per_proc,
                       "config": args.config, "overrides": args.overrides, "steps": args.steps, "skip": args.skip,
                       "peak_flops": peaks, "flops_per_token": fpt, "parameters": params, "cases": table}, f, indent=2)
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
