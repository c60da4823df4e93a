"""Section ``layer_bench``: ``python -m benchmarks.layer`` at ep=1, each expert kernel against the
floor; a kernel that fails alone is run again by itself while time lasts."""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Optional

from .context import Context, SectionFailed, check_device, run_command


KERNELS = ("auto", "loop", "bmm", "grouped_mm")


def bench_cmd(ctx: Context, kernels: str) -> list[str]:
    """The layer benchmark at ep=1, moe_dist against the floor, bf16 on a GPU (fp32 on the CPU)."""
    dtype = "fp32" if ctx.device == "cpu" else "bf16"
    return [sys.executable, "-m", "benchmarks.layer", "--device", ctx.device, "--dtypes", dtype, "--ep", "1",
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
