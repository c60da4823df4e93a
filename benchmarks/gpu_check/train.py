"""Section ``train``: ``moe-dist train`` of the main job and of the TinyLlama slice, one process each:
tokens/s, model FLOPs utilisation (:class:`moe_dist.train.observe.mfu.Utilisation`'s FLOPs per token and
model FLOP/s, against three peaks), peak memory."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from .context import Context, SectionFailed, check_device, read_json, result_path, run_command
from .settings import BIG_CONFIG, BIG_NAME, BIG_RUN_S, MAIN_CONFIG, common_overrides, train_dtype


def read_run(run_dir: str, skip_steps: int) -> dict:
    """tokens/s of the steps after the first ``skip_steps`` (median per step, and over all of them
    together), and what summary.json says of memory and loss."""
    from moe_dist.train.observe.metrics import read_metrics

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


def utilisation(config_yaml: str, device: str):
    """The trainer's MFU arithmetic (:class:`moe_dist.train.observe.mfu.Utilisation`, one process) for a run's
    config, its vocabulary resolved as the planner resolves it."""
    import torch

    from moe_dist.plan.plan_input import load_plan_input
    from moe_dist.train.observe.mfu import Utilisation

    inp = load_plan_input(config_yaml)
    return Utilisation(inp.model, inp.model.vocab_size, inp.seq_len, torch.device(device), train_dtype(device), 1)


def train_flops_per_token(config_yaml: str) -> float:
    """Training FLOPs of one token of a run's config (those the trainer's MFU counts)."""
    return utilisation(config_yaml, "cpu").flops_per_token


def significant(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def mfu(util, tokens_per_s: float, device_figs: dict) -> dict:
    """Model FLOPs utilisation of ``util`` (:func:`utilisation`) at ``tokens_per_s`` against the measured
    matmul rate, the planner's default rate (``moe-dist plan --compute-tflops``) and the datasheet's."""
    from moe_dist.plan.planner import DEFAULT_COMPUTE_TFLOPS

    achieved = util.achieved(tokens_per_s) / 1e12
    out = {"model_tflops": significant(achieved), "train_flops_per_token": util.flops_per_token,
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
    figs.update(mfu(utilisation(os.path.join(run_dir, "config.yaml"), ctx.device), figs["tokens_per_s_median"],
                    (read_json(result_path(ctx.work, "device")) or {}).get("figures", {})))
    figs.update(wall_s=round(time.monotonic() - t0, 1), command=" ".join(cmd[2:]), run_dir=run_dir)
    print(f"train {name}: {figs['tokens_per_s_median']:.0f} tokens/s (median of {figs['steps_timed']} steps), "
          f"MFU {figs['mfu_vs_measured_matmul']} of the measured matmul, {figs['mfu_vs_planner_default']} of "
          f"{figs['planner_default_tflops']:g} TFLOP/s; peak allocated {figs['cuda_peak_allocated_gib']} GiB", flush=True)
    return figs


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
