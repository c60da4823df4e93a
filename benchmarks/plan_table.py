"""The planner's predicted step time for the presets on paper: flat against hierarchical dispatch and
node-limited routing, at several cluster sizes, and a few regimes around one layout.

    python -m benchmarks.plan_table [--gpus 8,64,512] [--gpus-per-node 8] [--intra-gbps 3600]
        [--inter-gbps 3200] [--alpha-us 10] [--compute-tflops 400] [--micro-batch 1]

Prints markdown tables (docs/dispatch.md has their output). Every GPU computes ``--micro-batch``
sequences of the preset's ``train.seq_len`` per micro-batch and the preset's ``train.grad_accum``
micro-batches per step (at 512 GPUs a preset's ``train.global_batch`` is smaller than the GPUs;
this keeps the work per GPU fixed). Cells: predicted seconds per step (inter-node GiB each GPU
sends per step); ``*`` marks a layout that needs activation checkpointing to fit 80 GiB.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from moe_dist.plan.planner import (DEFAULT_ALPHA_US, DEFAULT_COMPUTE_TFLOPS, DEFAULT_INTER_GBPS, DEFAULT_INTRA_GBPS,
                            make_network, plan)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout (benchmarks/ is at its top)
PRESETS = ("olmoe-1b-7b", "tinyllama-upcycle-8x2", "phi3-mini-upcycle-4x2")
COLUMNS = (("flat", None), ("hierarchical", None), ("hierarchical", 1), ("hierarchical", 2))
REGIMES = (  # around OLMoE at 64 GPUs, ep=64 (8 nodes): one change each
    ("OLMoE as configured (d_model 2048, top-8 of 64)", [], {}),
    ("top-2 instead of top-8", ["model.moe.top_k=2"], {}),
    ("d_model 512 (compute falls faster than bytes)", ["model.d_model=512", "model.n_heads=8", "model.n_kv_heads=8"], {}),
    ("8x slower uplink (400 Gbit/s per node)", [], {"inter_gbps": DEFAULT_INTER_GBPS / 8}),
    ("uplink as fast as NVLink (3600 Gbit/s per GPU)", [], {"inter_gbps": DEFAULT_INTRA_GBPS * 8}),
)


def _cell(v: Optional[dict]) -> str:
    if v is None:
        return "-"
    star = "*" if v["activation_checkpointing"] else ""
    return f"{v['step_s']:.3f}{star} ({v['inter_bytes_per_gpu_per_step'] / 2**30:.1f})"


def _variants(layout: dict) -> dict:
    return {(v["dispatch"], v["max_groups"]): v for v in layout["dispatch"]}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plan_table", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="8,64,512")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--intra-gbps", type=float, default=DEFAULT_INTRA_GBPS)
    ap.add_argument("--inter-gbps", type=float, default=DEFAULT_INTER_GBPS)
    ap.add_argument("--alpha-us", type=float, default=DEFAULT_ALPHA_US)
    ap.add_argument("--compute-tflops", type=float, default=DEFAULT_COMPUTE_TFLOPS)
    ap.add_argument("--micro-batch", type=int, default=1)
    args = ap.parse_args(argv)
    g = args.gpus_per_node
    links = dict(intra_gbps=args.intra_gbps, inter_gbps=args.inter_gbps, alpha_us=args.alpha_us,
                 compute_tflops=args.compute_tflops)
    net = make_network(max_groups=(1, 2), **links)
    print(f"Intra-node {args.intra_gbps:g} Gbit/s per GPU, inter-node {args.inter_gbps:g} Gbit/s per node of {g} GPUs, "
          f"alpha {args.alpha_us:g} us, {args.compute_tflops:g} TFLOP/s per GPU, {args.micro_batch} sequence(s) per GPU "
          "per micro-batch. Seconds per step (inter-node GiB per GPU per step); M: node-limited routing.\n")
    print("| preset | GPUs | ep | ep nodes | flat | hierarchical | hierarchical M=1 | hierarchical M=2 |")
    print("|---|---|---|---|---|---|---|---|")
    for preset in PRESETS:
        config = os.path.join(ROOT, "configs", f"{preset}.yaml")
        for gpus in (int(x) for x in args.gpus.split(",")):
            p = plan(config, gpus // g, g, 80.0, micro_batch=args.micro_batch, network=net)
            for layout in p["layouts"]:
                if layout["ep"] < g and layout["ep"] != max(l["ep"] for l in p["layouts"]):
                    continue  # the groups inside one node: only the largest is shown
                v = _variants(layout)
                print(f"| {preset} | {gpus} | {layout['ep']} | {max(1, layout['ep'] // g)} | "
                      + " | ".join(_cell(v.get(key)) for key in COLUMNS) + " |")
    print("\nRegimes: OLMoE at 64 GPUs, ep=64 (8 nodes), one change each.\n")
    print("| regime | flat | hierarchical | hierarchical M=1 | hierarchical M=2 |")
    print("|---|---|---|---|---|")
    for name, overrides, change in REGIMES:
        regime_net = make_network(max_groups=(1, 2), **{**links, **change})
        p = plan(os.path.join(ROOT, "configs", "olmoe-1b-7b.yaml"), 64 // g, g, 80.0, overrides,
                 micro_batch=args.micro_batch, network=regime_net)
        v = _variants(next(l for l in p["layouts"] if l["ep"] == 64))
        print(f"| {name} | " + " | ".join(_cell(v.get(key)) for key in COLUMNS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
