"""Benchmark one MoE layer: forward + backward tokens/s and peak memory.

    python -m benchmarks.layer                # the full set (takes a while on 2 cores)
    python -m benchmarks.layer --quick        # a subset in under a minute
    python -m benchmarks.layer --json --routers topk,xmoe --tokens 4096 --ep 1

Compares, in the same rounds, this project's layer (``moe_dist``, any registered router),
DeepSpeed-MoE (``deepspeed``, skipped with a message when it is not installed) and the
``floor``: the bare expert matmuls on the same routed tokens (batched matmul,
``torch._grouped_mm`` and a per-expert loop; the fastest counts). ``--ep 2`` runs two gloo
processes with expert parallelism and, on the same processes, the no-expert-parallel
control. ``--tokens`` is per process. The table goes to stdout; with ``--json`` stdout has
one JSON object per case instead and the table goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

from moe_dist.tuning.bf16 import slow_bf16_note
from .cli_args import add_size_arguments, check_routers, sizes_from_args
from .report import table, target_check
from .runner import IMPLS, BenchConfig, log, progress, run_processes, run_single
from .timing import busy_note
from .workload import DTYPES

QUICK = dict(tokens=[4096], dtypes=["fp32", "bf16"], ep=[1], repeats=3, warmup=1)
FULL = dict(tokens=[4096, 16384, 65536], dtypes=["fp32", "bf16"], ep=[1, 2], repeats=5, warmup=2)


def _kernels(text: str) -> list:
    from moe_dist.moe.experts import KERNELS

    out = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in out if k not in KERNELS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"{bad or text!r}: allowed: {', '.join(KERNELS)} (comma-separated)")
    return list(dict.fromkeys(out))


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def _names(allowed, what):
    def parse(s: str) -> list[str]:
        vals = [v for v in s.split(",") if v]
        bad = [v for v in vals if v not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"{what} {bad} not known; allowed: {sorted(allowed)}")
        return vals
    return parse


def _capacity(s: str):
    if s.lower() in ("none", "dropless"):
        return None
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"--capacity-factor must be > 0 or 'none', got {s}")
    return v


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.layer", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"a subset: {QUICK}")
    p.add_argument("--json", action="store_true", help="one JSON object per case on stdout")
    p.add_argument("--tokens", type=_ints, help=f"tokens per process (default {FULL['tokens']})")
    p.add_argument("--dtypes", type=_names(DTYPES, "dtype"), help="fp32,bf16 (default both)")
    p.add_argument("--ep", type=_ints, help="expert-parallel sizes; N > 1 runs N processes (default 1,2)")
    p.add_argument("--impls", type=_names(IMPLS, "impl"), default=list(IMPLS), help="moe_dist,floor,deepspeed")
    p.add_argument("--routers", type=lambda s: [v for v in s.split(",") if v], default=["topk"],
                   help="registered router names for impl=moe_dist (default topk)")
    p.add_argument("--router-options", type=json.loads, default={},
                   help='JSON: router name -> options, e.g. \'{"xmoe": {"proj_dim": 16}}\'')
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens are [tokens/seq_len, seq_len, d] sequences (RouterInputs.batch_shape, token-graph routers)")
    p.add_argument("--skew", type=float, default=0.0,
                   help="Zipf-like router preference: logits get -skew*log(1+e) for expert e (0 = none)")
    p.add_argument("--capacity-factor", type=_capacity, default=None, help="'none' = dropless (default)")
    p.add_argument("--min-capacity", type=int, default=0)
    add_size_arguments(p)
    p.add_argument("--expert-kernel", type=_kernels, default=["loop"],
                   help="the layer's expert kernel(s), comma-separated, each timed in the same rounds: auto (the "
                        "trainer's choice, decided once over all ranks), loop, bmm, grouped_mm; with auto and fixed "
                        "kernels together the table shows auto's time over the best fixed kernel's")
    p.add_argument("--repeats", type=int, help="timed rounds per case (median reported)")
    p.add_argument("--warmup", type=int, help="untimed steps per implementation first")
    p.add_argument("--threads", type=int, default=None, help="threads per process (default: cores / processes)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    p.add_argument("--malloc", choices=["default", "keep"], default="default",
                   help="keep: glibc malloc keeps freed memory, no page faults per step (benchmarks.allocator)")
    p.add_argument("--device", default="cpu", help="torch device type (cpu, cuda, ...)")
    p.add_argument("--seed", type=int, default=0)
    return p


def config_from_args(args) -> tuple[BenchConfig, list[int]]:
    base = QUICK if args.quick else FULL
    pick = lambda name: getattr(args, name) if getattr(args, name) is not None else base[name]  # noqa: E731
    check_routers(args.routers)
    sizes = sizes_from_args(args, capacity_factor=args.capacity_factor, min_capacity=args.min_capacity)
    cfg = BenchConfig(sizes=sizes, tokens=pick("tokens"), dtypes=pick("dtypes"), impls=args.impls, routers=args.routers,
                      router_options=args.router_options, seq_len=args.seq_len, skew=args.skew, repeats=pick("repeats"),
                      warmup=pick("warmup"), threads=args.threads, device=args.device, seed=args.seed,
                      expert_kernels=args.expert_kernel, memory=not args.no_memory, malloc=args.malloc)
    eps = pick("ep")
    for ep in eps:
        if ep < 1 or sizes.num_experts % ep:
            raise SystemExit(f"--ep {ep} must be >= 1 and divide --experts {sizes.num_experts}")
    return cfg, eps


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    cfg, eps = config_from_args(args)
    # results go to the original stdout; everything else that writes to fd 1 (DeepSpeed's
    # prints and logs, the profiler) goes to stderr
    sys.stdout.flush()
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    log(f"moe_dist layer benchmark: torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores ({torch.backends.cpu.get_cpu_capability()}), load average "
        f"{os.getloadavg()[0]:.2f}; sizes {cfg.sizes}")
    slow = slow_bf16_note(torch.device(args.device), "bf16" if "bf16" in cfg.dtypes else "fp32")
    if slow:
        log(slow)
    busy = busy_note(max(eps), "at the start")
    if busy:
        log(busy)

    def emit(rec):
        progress(rec)
        if args.json:
            results.write(json.dumps(rec) + "\n")

    records = []
    for ep in eps:
        log(f"layout: ep={ep} ({'1 process' if ep == 1 else f'{ep} processes, with the no-EP control'})")
        if ep == 1:
            records += run_single(cfg, emit)
        else:
            for rec in run_processes(cfg, ep, ep):
                emit(rec)
                records.append(rec)
    text = table(records) + "\n\nTargets:\n" + "\n".join(target_check(records)) + "\n"
    busy = busy_note(max(eps), "at the end")
    if busy:
        text += busy + "\n"
    if args.json:
        log("\n" + text)
    else:
        results.write("\n" + text)
    results.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
