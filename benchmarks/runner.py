"""Runs the cases of one process layout and measures them.

All implementations of a case are timed in the same rounds (each round runs every one
once, in a rotated order), so machine load hits them alike; ratios are medians of the
per-round ratios. With several processes each step starts after a barrier and a step's
time is the slowest rank's.
"""
from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from moe_dist.distributed import ParallelGroups, build_parallel_groups
from moe_dist.ports import free_port
from .allocator import keep_freed_memory
from .impls import FLOOR_KERNELS, FloorImpl, Impl, MoEDistImpl
from .timing import median, peak_step_memory, timed
from .workload import DTYPES, Sizes, Workload

IMPLS = ("moe_dist", "floor", "deepspeed")


@dataclass
class BenchConfig:
    sizes: Sizes = field(default_factory=Sizes)
    tokens: list = field(default_factory=lambda: [4096, 16384, 65536])  # per process
    dtypes: list = field(default_factory=lambda: ["fp32", "bf16"])
    impls: list = field(default_factory=lambda: list(IMPLS))
    routers: list = field(default_factory=lambda: ["topk"])
    router_options: dict = field(default_factory=dict)  # router name -> options
    seq_len: Optional[int] = None
    skew: float = 0.0
    repeats: int = 5
    warmup: int = 2
    threads: Optional[int] = None  # per process; default: the cores shared out evenly
    device: str = "cpu"
    seed: int = 0
    expert_kernels: list = field(default_factory=lambda: ["loop"])  # each timed in the same rounds
    memory: bool = True
    malloc: str = "default"  # "keep": glibc keeps freed memory (benchmarks.allocator)


def apply_malloc(cfg: BenchConfig) -> None:
    if cfg.malloc == "keep" and not keep_freed_memory():
        log("--malloc keep: not a glibc system, the allocator is left as it is")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _device(cfg: BenchConfig, rank: int) -> torch.device:
    dev = torch.device(cfg.device)
    return dev if dev.type == "cpu" else torch.device(dev.type, rank)


def _build_impls(cfg: BenchConfig, work: Workload, procs: int, ep: int, groups: dict, ds_ok: bool) -> list[tuple[dict, Impl]]:
    """(labels, implementation) pairs of one case. One process: floor kernels, the layer per
    router, DeepSpeed. Several: the layer with expert parallelism ``ep`` and without (the
    control, ep=1 on the same processes), and DeepSpeed likewise."""
    out = []
    eps = [1] if procs == 1 else [ep, 1]
    if procs == 1 and "floor" in cfg.impls:
        for kernel in FLOOR_KERNELS:
            impl = FloorImpl(work, kernel)
            if impl.supported:
                out.append(({"impl": "floor", "router": "-", "ep": 1}, impl))
    for e in eps:
        if "moe_dist" in cfg.impls:
            for router in cfg.routers:
                for kernel in cfg.expert_kernels:
                    impl = MoEDistImpl(work, router, groups[e], cfg.router_options.get(router), kernel)
                    out.append(({"impl": "moe_dist", "router": router, "ep": e, "expert_kernel": kernel}, impl))
        if "deepspeed" in cfg.impls and ds_ok:
            from .deepspeed_impl import DeepSpeedImpl

            out.append(({"impl": "deepspeed", "router": "topk", "ep": e}, DeepSpeedImpl(work, e)))
    return out


def _measure(cfg: BenchConfig, impls: list[Impl], device: torch.device, distributed: bool) -> tuple[list, list, list, list]:
    """Per-round wall and CPU step times and page faults [impl][round] (seconds; the largest
    over ranks) and peak bytes per impl (largest rank)."""
    def barrier():
        if distributed:
            dist.barrier()

    for impl in impls:
        for _ in range(cfg.warmup):
            barrier()
            impl.step()
    n = len(impls)
    times = [[0.0] * cfg.repeats for _ in range(n)]
    cpu = [[0.0] * cfg.repeats for _ in range(n)]
    faults = [[0.0] * cfg.repeats for _ in range(n)]
    for r in range(cfg.repeats):
        for j in range(n):
            i = (j + r) % n  # rotate so no implementation always runs right after the same one
            barrier()
            times[i][r], cpu[i][r], faults[i][r] = timed(impls[i].step, device)
    peaks = [0] * n
    if cfg.memory:
        for i, impl in enumerate(impls):
            gc.collect()
            barrier()
            peaks[i] = peak_step_memory(impl.step, device)
    if distributed:
        t = torch.tensor([times, cpu, faults], dtype=torch.float64)
        p = torch.tensor(peaks, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(p, op=dist.ReduceOp.MAX)
        (times, cpu, faults), peaks = t.tolist(), [int(v) for v in p.tolist()]
    return times, cpu, faults, peaks


def _paired(a: list, b: list) -> float:
    return median([x / y for x, y in zip(a, b)])


def add_ratios(records: list[dict]) -> None:
    """Time ratios (this / other, medians of per-round ratios; < 1 means faster) against the
    fastest floor kernel, DeepSpeed, the no-expert-parallel control and the topk router."""
    floors = [r for r in records if r["impl"] == "floor"]
    best = min(floors, key=lambda r: r["step_ms"]) if floors else None
    for r in floors:
        r["fastest_floor"] = r is best

    def find(**kv):
        return next((o for o in records if all(o[k] == v for k, v in kv.items())), None)

    for r in records:
        if r["impl"] == "floor":
            continue
        t = r["_times"]
        if best is not None and r["procs"] == 1:
            r["time_vs_floor"] = _paired(t, best["_times"])
            r["floor_kernel"] = best["kernel"]
        setting = {"expert_kernel": r["expert_kernel"]} if "expert_kernel" in r else {}
        if r["impl"] == "moe_dist":
            ds = find(impl="deepspeed", ep=r["ep"], procs=r["procs"])
            if ds is not None:
                r["time_vs_deepspeed"] = _paired(t, ds["_times"])
            if r["router"] != "topk":
                top = find(impl="moe_dist", router="topk", ep=r["ep"], procs=r["procs"], **setting)
                if top is not None:
                    r["time_vs_topk"] = _paired(t, top["_times"])
            if r.get("expert_kernel") == "auto":  # against the fastest fixed kernel of the same case
                fixed = [o for o in records if o["impl"] == "moe_dist" and o.get("expert_kernel") not in (None, "auto")
                         and (o["router"], o["ep"], o["procs"]) == (r["router"], r["ep"], r["procs"])]
                if fixed:
                    best_fixed = min(fixed, key=lambda o: o["step_ms"])
                    r["time_vs_best_fixed"] = _paired(t, best_fixed["_times"])
                    r["best_fixed_kernel"] = best_fixed["expert_kernel"]
        if r["ep"] > 1:
            ctl = find(impl=r["impl"], router=r["router"], ep=1, procs=r["procs"], **setting)
            if ctl is not None:
                r["time_vs_control"] = _paired(t, ctl["_times"])


def run_layout(cfg: BenchConfig, procs: int, ep: int, rank: int = 0, emit=None) -> list[dict]:
    """Every (dtype, tokens) case on this layout. Runs on every rank; returns the records
    (identical on all ranks). ``emit(record)`` is called as each case finishes (rank 0)."""
    distributed = procs > 1
    device = _device(cfg, rank)
    ds_ok = False
    if "deepspeed" in cfg.impls:
        from .deepspeed_impl import deepspeed_available, init_deepspeed_comm

        ds_ok, why = deepspeed_available()
        if not ds_ok:
            if rank == 0:
                log(f"skipping impl=deepspeed: deepspeed is not importable ({why}); "
                    "install it with: DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 pip install --no-build-isolation deepspeed==0.19.8")
        else:
            init_deepspeed_comm()
    groups = {1: build_parallel_groups(1) if distributed else ParallelGroups.single()}
    if distributed:
        groups[ep] = build_parallel_groups(ep, cfg.sizes.num_experts)
    all_records = []
    for dtype_name in cfg.dtypes:
        for tokens in cfg.tokens:
            work = Workload(cfg.sizes, tokens, DTYPES[dtype_name], device, cfg.seq_len, cfg.skew, cfg.seed, rank)
            labelled = _build_impls(cfg, work, procs, ep, groups, ds_ok)
            load_before = os.getloadavg()[0]
            times, cpu, faults, peaks = _measure(cfg, [i for _, i in labelled], device, distributed)
            load_after = os.getloadavg()[0]
            records = []
            for (labels, impl), t, c, pf, peak in zip(labelled, times, cpu, faults, peaks):
                step = median(t)
                rec = dict(labels, procs=procs, tokens=tokens, global_tokens=tokens * procs, dtype=dtype_name,
                           **impl.info(), seq_len=cfg.seq_len, d_model=cfg.sizes.d_model, d_ff=cfg.sizes.d_ff,
                           heads=cfg.sizes.heads, kv_heads=cfg.sizes.kv_heads or cfg.sizes.heads, skew=cfg.skew, capacity_factor=cfg.sizes.capacity_factor,
                           malloc=cfg.malloc, page_faults=int(median(pf)),
                           threads=torch.get_num_threads(), repeats=cfg.repeats, step_ms=1e3 * step,
                           step_ms_min=1e3 * min(t), cpu_ms=1e3 * median(c), tokens_per_s=tokens * procs / step,
                           time_per_token_us=1e6 * step / (tokens * procs),
                           peak_mem_mib=peak / 2**20 if cfg.memory else None,
                           load_avg=round((load_before + load_after) / 2, 2), _times=t)
                records.append(rec)
            add_ratios(records)
            for rec in records:
                rec["step_ms_all"] = [round(1e3 * v, 3) for v in rec.pop("_times")]
                if emit is not None and rank == 0:
                    emit(rec)
            all_records += records
            del labelled, work
            gc.collect()
    return all_records


def progress(rec: dict) -> None:
    """One line on stderr per finished case."""
    log(f"  done: {rec['impl']:<9} {rec['router']:<8} ep={rec['ep']} procs={rec['procs']} {rec['dtype']} "
        f"tokens={rec['tokens']} kernel={rec.get('kernel', '-')}: {rec['step_ms']:.1f} ms/step, "
        f"{rec['tokens_per_s']:.0f} tok/s")


# ---- several processes ----------------------------------------------------------------
def _worker(rank: int, procs: int, ep: int, port: int, cfg: BenchConfig, out_dir: str) -> None:
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // procs)
    torch.set_num_threads(threads)
    apply_malloc(cfg)
    path = os.path.join(out_dir, f"rank{rank}.json")
    try:
        backend = "gloo" if torch.device(cfg.device).type == "cpu" else None
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=procs,
                                timeout=datetime.timedelta(minutes=30))
        records = run_layout(cfg, procs, ep, rank, emit=progress)
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"ok": True, "records": records}, f)
    except BaseException:  # noqa: BLE001 - the parent reports every rank's failure
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"ok": False, "error": traceback.format_exc()}, f)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_processes(cfg: BenchConfig, procs: int, ep: int) -> list[dict]:
    """Run the layout on ``procs`` fresh processes (one process group) and return rank 0's
    records."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = free_port()
        ps = [ctx.Process(target=_worker, args=(r, procs, ep, port, cfg, out_dir)) for r in range(procs)]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        errors, records = [], None
        for r in range(procs):
            path = os.path.join(out_dir, f"rank{r}.json")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {ps[r].exitcode})")
                continue
            with open(path, encoding="utf-8") as f:
                res = json.load(f)
            if not res["ok"]:
                errors.append(f"rank {r}:\n{res['error']}")
            elif r == 0:
                records = res["records"]
        if errors:
            raise RuntimeError("benchmark processes failed:\n" + "\n".join(errors))
        return records


def run_single(cfg: BenchConfig, emit=None) -> list[dict]:
    """The one-process layout (ep 1) in this process. DeepSpeed needs a process group even
    alone, so a one-rank gloo group is made for the duration when it is requested."""
    apply_malloc(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    own_group = False
    if "deepspeed" in cfg.impls and not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        own_group = True
    try:
        return run_layout(cfg, 1, 1, 0, emit)
    finally:
        if own_group:
            dist.destroy_process_group()
