"""The planner against the dry run for the presets at several cluster sizes (the table in
benchmarks/results/scale.md, "Dry run against the planner").

    python -m benchmarks.dry_run_table [--gpus 8,16,64] [--presets tinyllama,phi3,olmoe,mixtral]
        [--gpus-per-node 8] [--out benchmarks/data/scale/dry-run-table.json]

For each preset and GPU count: the dry run of the busiest rank (balanced routing, one step) at one
sequence per GPU per micro-batch, its memory per category at the peak next to the planner's, and
the dry run's wall time. Results are written after every case (a long table can be stopped).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

PRESETS = {"tinyllama": ("configs/tinyllama-upcycle-8x2.yaml", []),
           "phi3": ("configs/phi3-mini-upcycle-4x2.yaml", []),
           "olmoe": ("configs/olmoe-1b-7b.yaml", []),
           "mixtral": ("configs/hf/mixtral-8x7b.json", ["parallel.ep=8"])}
GIB = float(1 << 30)


def case(name: str, gpus: int, gpus_per_node: int) -> dict:
    from moe_dist.plan.dry_run import dry_run
    from moe_dist.plan.dry_run_report import comparison_rows, with_planner

    config, extra = PRESETS[name]
    nodes = max(1, gpus // gpus_per_node)
    per_node = gpus if gpus < gpus_per_node else gpus_per_node
    overrides = extra + [f"eval.batch={gpus}"]
    start = time.perf_counter()
    result = with_planner(dry_run(config, overrides, nodes=nodes, gpus_per_node=per_node, micro_batch=1))
    rows = [{"category": c, "dry_run_gib": round(d, 3), "planner_gib": None if p is None else round(p, 3)}
            for c, d, p in comparison_rows(result)]
    return {"preset": name, "gpus": gpus, "layout": result["layout"], "rows": rows,
            "recommended_ep": result["planner"]["recommended_ep"], "seconds": round(time.perf_counter() - start, 1)}


def markdown(cases: list[dict]) -> str:
    """The table for benchmarks/results/scale.md: peak and the categories that differ, dry run / planner (GiB)."""
    keys = [("weights (this rank's shards)", "weights"), ("optimizer state", "optimizer"),
            ("activations", "activations"), ("peak", "peak")]
    head = "| preset | GPUs | ep/edp | " + " | ".join(f"{k} dry run / planner" for _, k in keys) + " | dry run s |"
    lines = [head, "|" + "---|" * (len(keys) + 4)]
    for c in cases:
        if "error" in c:
            lines.append(f"| {c['preset']} | {c['gpus']} | {c['error'][:80]} |" + " |" * (len(keys) + 1))
            continue
        rows = {r["category"]: r for r in c["rows"]}
        cells = [f"{rows[k]['dry_run_gib']:.2f} / {rows[k]['planner_gib']:.2f}" for k, _ in keys]
        lay = c["layout"]
        lines.append(f"| {c['preset']} | {c['gpus']} | {lay['ep']}/{lay['edp']} | " + " | ".join(cells)
                     + f" | {c['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="8,16,64")
    p.add_argument("--presets", default=",".join(PRESETS))
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--out", default="benchmarks/data/scale/dry-run-table.json")
    p.add_argument("--markdown", metavar="JSON", help="print the table of an earlier run's JSON and stop")
    a = p.parse_args(argv)
    if a.markdown:
        with open(a.markdown, encoding="utf-8") as f:
            print(markdown(json.load(f)))
        return 0
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores", flush=True)
    done = []
    for name in a.presets.split(","):
        for gpus in (int(g) for g in a.gpus.split(",")):
            try:
                r = case(name, gpus, a.gpus_per_node)
            except Exception as e:  # one case's failure is a result too
                r = {"preset": name, "gpus": gpus, "error": f"{type(e).__name__}: {e}"[:500]}
            done.append(r)
            peak = next((x for x in r.get("rows", []) if x["category"] == "peak"), None)
            print(name, gpus, r.get("seconds"), peak or r.get("error"), flush=True)
            with open(a.out, "w", encoding="utf-8") as f:
                json.dump(done, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
