"""Command-line pieces the layer and router benchmarks share: the layer's sizes and the router check."""
from __future__ import annotations

import argparse

from moe_dist.moe.routers import ROUTERS
from .workload import Sizes


def add_size_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--heads", type=int, default=8,
                   help="attention heads of the synthetic attention that attention-aware routers read (d_head = d_model/heads)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads of that attention (GQA; default: --heads)")
    p.add_argument("--activation", choices=["swiglu", "gelu"], default="swiglu")


def sizes_from_args(args, **extra) -> Sizes:
    """:class:`Sizes` from :func:`add_size_arguments`' options (``extra``: more Sizes fields)."""
    kv = args.kv_heads or args.heads
    if args.heads < 1 or args.d_model % args.heads or kv < 1 or args.heads % kv:
        raise SystemExit(f"--heads {args.heads} must divide --d-model {args.d_model}, and --kv-heads {args.kv_heads} "
                         "must divide --heads")
    return Sizes(d_model=args.d_model, d_ff=args.d_ff, num_experts=args.experts, top_k=args.top_k,
                 activation=args.activation, heads=args.heads, kv_heads=args.kv_heads, **extra)


def check_routers(names: list[str]) -> None:
    unknown = [r for r in names if r not in ROUTERS]
    if unknown:
        raise SystemExit(f"--routers: {unknown} not registered; allowed: {sorted(ROUTERS)}")
