"""Flat vs hierarchical dispatch vs node-limited routing on 2 namespace nodes x 2 ranks, rate-limited links.

    .venv/bin/python -m benchmarks.node_dispatch_bench [--rates 200mbit,none] [--rounds 1] [--steps 12]
        [--warmup 4] [--variants flat,hier,flat-m1,hier-m1] [--out runs/node-dispatch] [--config configs/tiny.yaml]
    .venv/bin/python -m benchmarks.node_dispatch_bench --from benchmarks/data/dispatch/flat-vs-hierarchical-2-nodes.json --out /tmp/x

Needs root and ``ip netns`` (:mod:`tests.helpers.cluster`). The main job's model at ``parallel.ep=4``
over 2 nodes of 2 ranks (``launch/torchrun.sh`` on each node, as ``python -m benchmarks.plan_time_check`` starts
them). Per variant and link rate: the step time (mean of the steps after ``--warmup``), the counted
all-to-all bytes per step (``a2a_inter_bytes`` / ``a2a_intra_bytes``, summed over the ranks), the
planner's prediction of the same bytes for a balanced router, node0's interface bytes per step and
the loss at the last step, and the planner's step time (its compute rate calibrated so that it
predicts the flat dispatch's measured step without a link limit). Rounds run every (rate, variant) once, variants interleaved, so a busy
machine's slow phases spread over all of them. Writes ``OUT/node_dispatch.json``.

Variants: ``flat`` (the default dispatch), ``hier`` (``parallel.dispatch=hierarchical``), ``flat-m1`` /
``hier-m1`` (node-limited routing, ``model.moe.router_groups=2 max_groups_per_token=1``: every token's
experts on one node), ``flat-m2`` (2 node groups, at most 2: at top-2 the limit cannot bind, so the
same model as ``flat``), ``hier-m2g4`` (4 groups, at most 2: never binding at top-2, a control).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from .plan_time_check import ALPHA_S, FREE_GBPS, PAYLOAD, ROOT, rate_gbps, run_two_nodes, step_times
from moe_dist.plan.planner import Network, make_network, plan
from moe_dist.plan.timing import Links

HIER = "parallel.dispatch=hierarchical"
M1 = ["model.moe.router_groups=2", "model.moe.max_groups_per_token=1"]
# name: (overrides, the planner's dispatch, the planner's node limit: None where the limit cannot bind)
VARIANTS = {
    "flat": ([], "flat", None),
    "hier": ([HIER], "hierarchical", None),
    "flat-m1": (M1, "flat", 1),
    "hier-m1": ([HIER, *M1], "hierarchical", 1),
    # M = 2 of 2 node groups: a token's 2 experts can always be on 2 nodes, so the limit never binds
    "flat-m2": (["model.moe.router_groups=2", "model.moe.max_groups_per_token=2"], "flat", None),
    "hier-m2g4": ([HIER, "model.moe.router_groups=4", "model.moe.max_groups_per_token=2"], "hierarchical", None),
}


def _row(config: str, overrides: list[str], dispatch: str, limit, network: Network) -> dict:
    """The planner's figures for the ep=4 layout of 2 nodes x 2 GPUs, this dispatch and node limit."""
    p = plan(config, 2, 2, 1000.0, ["parallel.ep=4", "parallel.backend=gloo", *overrides], network=network)
    four = next(l for l in p["layouts"] if l["ep"] == 4)["dispatch"]
    return next(v for v in four if v["dispatch"] == dispatch and v["max_groups"] == limit)


def predicted_bytes(config: str, overrides: list[str], dispatch: str, limit) -> tuple[float, float]:
    """The planner's (intra, inter) dispatch bytes per step over all 4 GPUs (2 nodes x 2), balanced router."""
    v = _row(config, overrides, dispatch, limit, make_network(dispatch=dispatch, max_groups=[limit] if limit else []))
    return v["intra_bytes_per_gpu_per_step"] * 4, v["inter_bytes_per_gpu_per_step"] * 4


def predicted_step(config: str, overrides: list[str], dispatch: str, limit, rate: str, rate_flops: float) -> float:
    """The planner's step time at a link rate (TCP payload of it; ``none``: a free link), compute at
    ``rate_flops`` per rank, FSDP2 not overlapped (CPU processes), as ``python -m benchmarks.plan_time_check``."""
    gbps = FREE_GBPS if rate == "none" else rate_gbps(rate) * PAYLOAD
    net = Network(links=Links(intra_gbps=FREE_GBPS, inter_gbps=gbps, alpha_s=ALPHA_S), compute_flops=rate_flops,
                  dispatches=(dispatch,), max_groups=(limit,) if limit else (), fsdp_overlap=False)
    return _row(config, overrides, dispatch, limit, net)["step_s"]


def table(args, results: dict, rates: list[str], variants: list[str]) -> None:
    """Per variant and rate: measured and predicted step time and bytes (added to each run's record).
    The compute rate is calibrated on the flat dispatch without a link limit (the planner's compute
    equals its measured step: loopback and the unlimited veth pair count as compute)."""
    flat_none = [r["step_s"] for r in results["runs"] if r["variant"] == "flat" and r["rate"] == "none"]
    rate_flops = None
    if flat_none:
        flops = predicted_step(args.config, args.overrides, "flat", None, "none", 1.0)
        rate_flops = flops / statistics.mean(flat_none)
        results["rate_flops_per_rank"] = rate_flops
        print(f"\ncompute rate from flat without a limit: {rate_flops / 1e9:.2f} GFLOP/s per rank")
    print(f"\n{'variant':>9} {'rate':>8} {'s/step (rounds)':>22} {'pred s':>7} {'inter MB/step':>13} {'predicted':>9} "
          f"{'ratio':>6} {'intra MB/step':>13} {'node0 tx MB':>11} {'loss':>7}")
    for variant in variants:
        overrides, dispatch, limit = VARIANTS[variant]
        overrides = [*overrides, *args.overrides]
        intra_p, inter_p = predicted_bytes(args.config, overrides, dispatch, limit)
        for rate in rates:
            runs = [r for r in results["runs"] if r["variant"] == variant and r["rate"] == rate]
            if not runs:
                continue
            step_p = predicted_step(args.config, overrides, dispatch, limit, rate, rate_flops) if rate_flops else float("nan")
            inter = statistics.mean(r["a2a_inter_bytes"] for r in runs)
            times = " / ".join(f"{r['step_s']:.3f}" for r in runs)
            print(f"{variant:>9} {rate:>8} {times:>22} {step_p:>7.3f} {inter / 1e6:>13.2f} "
                  f"{inter_p / 1e6:>9.2f} {inter / inter_p if inter_p else float('nan'):>6.3f} "
                  f"{statistics.mean(r['a2a_intra_bytes'] for r in runs) / 1e6:>13.2f} "
                  f"{statistics.mean(r['node0_tx_bytes_per_step'] for r in runs) / 1e6:>11.2f} "
                  f"{statistics.mean(r['last_loss'] for r in runs):>7.4f}")
            for r in runs:
                r.update(predicted_inter_bytes=inter_p, predicted_intra_bytes=intra_p, predicted_step_s=step_p)


def measure(args, variant: str, rate: str, rnd: int) -> dict:
    name = f"{variant}-{rate}-r{rnd}"
    ns = argparse.Namespace(out=args.out, steps=args.steps, config=args.config,
                            overrides=[*VARIANTS[variant][0], *args.overrides], warmup=args.warmup)
    got = run_two_nodes(ns, name, None if rate == "none" else rate)
    run_dir = os.path.join(args.out, name)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    after = [r for r in rows if r["step"] > args.warmup]
    return {"step_s": got["step_s"], "steps_s": step_times(run_dir, args.warmup),
            "a2a_inter_bytes": statistics.mean(r["a2a_inter_bytes"] for r in after),
            "a2a_intra_bytes": statistics.mean(r["a2a_intra_bytes"] for r in after),
            "node0_tx_bytes_per_step": got["node0_tx_bytes"] / args.steps, "last_loss": rows[-1]["loss"],
            "groups_per_token_max": max((layer.get("groups_per_token_max") or 0.0 for r in rows
                                         for layer in r.get("moe", {}).values()), default=0.0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="200mbit,none")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--variants", default="flat,hier,flat-m1,hier-m1")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "node-dispatch"))
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--from", dest="source", default=None, metavar="JSON",
                    help="no runs: the table again for an earlier node_dispatch.json (written again to --out)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    rates, variants = args.rates.split(","), args.variants.split(",")
    if args.source:
        with open(args.source) as f:
            results = json.load(f)
        args.config, args.overrides = results["config"], results.get("overrides", [])
        seen = [r["variant"] for r in results["runs"]]
        table(args, results, list(dict.fromkeys(r["rate"] for r in results["runs"])),
              [v for v in VARIANTS if v in seen])
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "node_dispatch.json"), "w") as f:
            json.dump(results, f, indent=1)
        return 0
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        ap.error(f"--variants: unknown {unknown}; allowed: {sorted(VARIANTS)}")
    os.makedirs(args.out, exist_ok=True)
    results: dict = {"config": args.config, "overrides": args.overrides, "steps": args.steps, "warmup": args.warmup, "runs": []}
    for rnd in range(args.rounds):
        for rate in rates:
            for variant in (variants if rnd % 2 == 0 else variants[::-1]):
                got = measure(args, variant, rate, rnd)
                results["runs"].append({"variant": variant, "rate": rate, "round": rnd, **got})
                print(f"round {rnd} {rate:>8} {variant:>9}: {got['step_s']:.3f} s/step, inter "
                      f"{got['a2a_inter_bytes'] / 1e6:.2f} MB/step, intra {got['a2a_intra_bytes'] / 1e6:.2f} MB/step, "
                      f"node0 tx {got['node0_tx_bytes_per_step'] / 1e6:.2f} MB/step, loss {got['last_loss']:.4f}, "
                      f"groups/token max {got['groups_per_token_max']:.0f}", flush=True)
                with open(os.path.join(args.out, "node_dispatch.json"), "w") as f:
                    json.dump(results, f, indent=1)
    table(args, results, rates, variants)
    with open(os.path.join(args.out, "node_dispatch.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
