"""Section ``host_syncs``: CUDA synchronisations, device copies and scalar reads per training step,
counted by the profiler, with the moe_dist source lines they come from."""
from __future__ import annotations

import torch

from moe_dist.hardware import synchronize

from .context import Context, SectionFailed, check_device
from .settings import MAIN_CONFIG, common_overrides


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
        synchronize(torch.device(device))
    return prof.events()


def section_host_syncs(ctx: Context) -> dict:
    import torch

    from moe_dist.config import load_config
    from moe_dist.train.loop.trainer import Trainer

    check_device(ctx.device)
    sz = ctx.sizes
    run_dir = ctx.fresh_dir("host_syncs", "run")
    cfg = load_config(MAIN_CONFIG, [*common_overrides(ctx.device, ctx.work), *sz.main_overrides, f"run.dir={run_dir}",
                                    "train.steps=1000"])
    trainer = Trainer(cfg)
    try:
        for _ in range(sz.sync_warmup):  # first-call work (allocator growth, cuBLAS handles) is not the steady state
            trainer.train_step()
        synchronize(torch.device(ctx.device))
        try:
            events = profiled_steps(trainer, sz.sync_steps, ctx.device, with_stack=True)
        except Exception as e:  # the Python tracer is the fragile part: count without source lines then
            print(f"profiling with Python stacks failed ({type(e).__name__}: {e}); profiling without them", flush=True)
            events = profiled_steps(trainer, sz.sync_steps, ctx.device, with_stack=False)
        counts, where = count_host_syncs(events)
        if counts["cudaDeviceSynchronize"]:  # the profile's last call, this check's own synchronize(), is not the step's
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
