"""Section ``memory_vs_dry_run``: the TinyLlama slice's peak allocated memory in training against
``moe-dist plan --dry-run``'s and the planner's."""
from __future__ import annotations

import os
import time
from typing import Optional

from .context import Context, Skip, check_device, read_json, result_path
from .settings import BIG_CONFIG, BIG_NAME, BIG_SLICE, CPU_SMALL_MODEL, common_overrides
from .train import train_run


def model_overrides(overrides) -> list[str]:
    """The overrides that shape the model and its step (what the dry run reads), not where it writes."""
    return [o for o in overrides if o.split("=", 1)[0].split(".")[0] in ("model", "train", "parallel", "data")
            and not o.startswith(("data.cache_dir", "train.steps"))]


def section_memory_vs_dry_run(ctx: Context) -> dict:
    check_device(ctx.device)
    try:
        from moe_dist.plan.dry_run import dry_run
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
        from moe_dist.plan.dry_run_report import with_planner
    except (ImportError, AttributeError):
        return None
    return with_planner(result).get("planner")
