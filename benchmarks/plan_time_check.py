"""The planner's step-time prediction against training on a namespace cluster with rate-limited links.

    .venv/bin/python -m benchmarks.plan_time_check [--rates 100mbit,300mbit,none] [--rounds 2] [--steps 25]
        [--warmup 5] [--out runs/plan-time-check] [--config configs/tiny.yaml] [KEY=VALUE ...]

Needs root and ``ip netns`` (:mod:`tests.helpers.cluster`). The main job's model at ``parallel.ep=4``,
flat dispatch, ``parallel.backend=gloo``:

1. **compute**: the run on one node (4 processes in this namespace, no network: the all-to-alls
   and FSDP2's collectives over loopback) gives the step time ``T1``; the planner's compute rate is
   set so that it predicts ``T1`` for that layout with free links (``rate = FLOPs of a step / T1``):
   a measured rate of this machine, loopback copies included, instead of a FLOP guess.
2. **2 nodes x 2 processes** on a :class:`~tests.helpers.cluster.Cluster` whose links are limited
   to each rate (``tc tbf``, both directions; ``none``: no limit): the measured step time against
   ``moe-dist plan``'s prediction for 2 nodes x 2 GPUs with ``--inter-gbps`` = the rate's TCP payload
   (``rate x 1448 / 1514``: a full Ethernet frame carries 1448 bytes of a TCP segment with timestamps)
   and the node-to-node throughput measured on an unlimited link for ``none``.

Every run's step time is the mean of the steps after ``--warmup`` (metrics.jsonl,
``global_batch x seq_len / tokens_per_s``); rounds interleave the cases (1 node, then each rate),
so a busy machine's slow phases spread over all of them. Prints a table (rate, measured per round,
predicted, ratio) and writes ``OUT/plan_time_check.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Optional

from moe_dist.plan.planner import Network, plan
from moe_dist.plan.timing import Links

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout (benchmarks/ is at its top)
QUIET = ["run.progress=false", "run.plots=false", "run.tensorboard=false", "ckpt.save_final=false",
         "eval.every=0", "eval.max_sequences=8", "run.print_every=1000"]
PAYLOAD = 1448 / 1514  # TCP payload of one full Ethernet frame (TCP timestamps on)
FREE_GBPS = 1e6  # a link that costs nothing
ALPHA_S = 100e-6  # one gloo message over TCP between namespaces, order of magnitude
RUN_TIMEOUT = 600


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK")}
    env.update(PYTHON=sys.executable, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **extra)
    return env


def _overrides(args, run_dir: str) -> list[str]:
    return [f"run.dir={run_dir}", f"data.cache_dir={args.out}/cache", f"train.steps={args.steps}",
            "parallel.ep=4", "parallel.backend=gloo", *QUIET, *args.overrides]


def step_times(run_dir: str, warmup: int) -> list[float]:
    """Seconds of every step after ``warmup`` (rank 0's metrics.jsonl)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    cfg_tokens = None
    times = []
    for row in rows:
        if row["step"] <= warmup:
            continue
        if cfg_tokens is None:
            cfg_tokens = row["tokens"] / row["step"]  # tokens of one step
        times.append(cfg_tokens / row["tokens_per_s"])
    return times


def run_one_node(args, name: str) -> float:
    run_dir = os.path.join(args.out, name)
    cmd = [sys.executable, "-m", "moe_dist.cli", "train", "--config", args.config, "--nproc", "4",
           *_overrides(args, run_dir)]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    if res.returncode != 0:
        raise RuntimeError(f"{name}: exit {res.returncode}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return statistics.mean(step_times(run_dir, args.warmup))


def run_two_nodes(args, name: str, rate: Optional[str]) -> dict:
    from tests.helpers.cluster import Cluster

    run_dir = os.path.join(args.out, name)
    with Cluster(2, rate=rate) as c:
        procs = []
        for i in range(2):
            env = _env(NPROC_PER_NODE="2", NNODES="2", NODE_RANK=str(i), MASTER_ADDR="node0", RDZV_ID=name)
            log = open(os.path.join(args.out, f"{name}.node{i}.log"), "w")
            procs.append((c.popen(c.nodes[i], ["bash", "launch/torchrun.sh", args.config, *_overrides(args, run_dir)],
                                  env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + RUN_TIMEOUT
        for p, log in procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.close()
        rx, tx = c.link_bytes(c.nodes[0])
    for i, (p, _) in enumerate(procs):
        if p.returncode != 0:
            with open(os.path.join(args.out, f"{name}.node{i}.log")) as f:
                text = f.read()
            raise RuntimeError(f"{name}: node{i} exited {p.returncode}\n{text[-3000:]}")
    return {"step_s": statistics.mean(step_times(run_dir, args.warmup)), "node0_tx_bytes": tx, "node0_rx_bytes": rx}


_SINK = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 29611)); s.listen(1)
conn, _ = s.accept(); n = 0
while True:
    b = conn.recv(1 << 20)
    if not b:
        break
    n += len(b)
print(n)
"""

_SOURCE = r"""
import socket, sys, time
total = int(sys.argv[1]); buf = b"x" * (1 << 20)
for _ in range(100):
    try:
        s = socket.create_connection(("node1", 29611)); break
    except OSError:
        time.sleep(0.1)
t = time.perf_counter(); sent = 0
while sent < total:
    s.sendall(buf); sent += len(buf)
s.shutdown(socket.SHUT_WR); s.recv(1); print(sent / (time.perf_counter() - t))
"""


def unlimited_gbps(nbytes: int = 512 << 20) -> float:
    """TCP payload throughput from node0 to node1 on an unlimited link (one stream, Gbit/s)."""
    from tests.helpers.cluster import Cluster

    with Cluster(2) as c:
        sink = c.popen(c.nodes[1], [sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
        out = c.run(c.nodes[0], [sys.executable, "-c", _SOURCE, str(nbytes)], timeout=120)
        sink.wait(timeout=60)
        if out.returncode != 0:
            raise RuntimeError(out.stderr)
        return float(out.stdout.strip()) * 8 / 1e9


def rate_gbps(rate: str) -> float:
    """A tc rate (``100mbit``, ``1gbit``, ``50mbps``) in Gbit/s."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "bps": 8.0}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 1e9
    raise ValueError(f"rate {rate!r}")


def predict(args, nodes: int, gpus_per_node: int, inter_gbps: float, rate_flops: float) -> dict:
    """The planner's flat-dispatch figures for the ep=4 layout."""
    net = Network(links=Links(intra_gbps=FREE_GBPS, inter_gbps=inter_gbps, alpha_s=ALPHA_S if nodes > 1 else 0.0),
                  compute_flops=rate_flops, dispatches=("flat",), max_groups=(), fsdp_overlap=False)
    p = plan(args.config, nodes, gpus_per_node, 1000.0, ["parallel.ep=4", "parallel.backend=gloo", *args.overrides],
             network=net)
    layout = next(l for l in p["layouts"] if l["ep"] == 4)
    return next(v for v in layout["dispatch"] if v["dispatch"] == "flat" and v["max_groups"] is None)


def compare(args, result: dict, rates: list[str]) -> None:
    """The compute rate from the 1-node runs, then each rate's prediction beside its measurements
    (added to ``result["table"]``, printed)."""
    t1 = statistics.mean(rnd["one_node_s"] for rnd in result["rounds"])
    flops = predict(args, 1, 4, FREE_GBPS, 1.0)["compute_s"]  # FLOPs of a step at 1 FLOP/s
    rate_flops = flops / t1
    result.update(one_node_s=t1, step_flops_per_rank=flops, rate_flops=rate_flops, table=[])
    one = " / ".join(f"{rnd['one_node_s']:.3f}" for rnd in result["rounds"])
    print(f"\ncompute rate from the 1-node runs ({one} s/step, mean {t1:.3f}; {flops / 1e9:.2f} GFLOP per rank per step): "
          f"{rate_flops / 1e9:.2f} GFLOP/s per rank")
    print(f"{'rate':>8} {'inter Gbit/s':>12} {'measured s/step (rounds)':>26} {'predicted':>9} {'ratio':>6} "
          f"{'per-round ratios':>16} {'exposed a2a':>11} {'sync':>6} {'link MB/step: a2a + sync = predicted':>37} "
          f"{'node0 tx MB/step':>16}")
    for rate in rates:
        gbps = result["unlimited_gbps"] if rate == "none" else rate_gbps(rate) * PAYLOAD
        pred = predict(args, 2, 2, gbps, rate_flops)
        measured = [rnd[rate]["step_s"] for rnd in result["rounds"]]
        mean = statistics.mean(measured)
        tx = statistics.mean(rnd[rate]["node0_tx_bytes"] for rnd in result["rounds"]) / args.steps / 1e6
        # each round against its own 1-node run (the machine's load drifts between rounds)
        per_round = [predict(args, 2, 2, gbps, flops / rnd["one_node_s"])["step_s"] / rnd[rate]["step_s"]
                     for rnd in result["rounds"]]
        a2a_mb = 2 * pred["inter_bytes_per_gpu_per_step"] / 1e6  # the node's 2 ranks
        sync_mb = pred["sync_bytes_per_gpu_per_step"] / 1e6  # one ring edge leaves each node
        row = {"rate": rate, "inter_gbps": gbps, "measured_s": measured, "predicted_s": pred["step_s"],
               "ratio": pred["step_s"] / mean, "per_round_ratios": per_round, "prediction": pred, "node0_tx_mb_per_step": tx,
               "predicted_link_mb_per_step": a2a_mb + sync_mb}
        result["table"].append(row)
        print(f"{rate:>8} {gbps:>12.3f} {' / '.join(f'{m:.3f}' for m in measured):>26} {pred['step_s']:>9.3f} "
              f"{row['ratio']:>6.3f} {' / '.join(f'{x:.3f}' for x in per_round):>16} {pred['exposed_all_to_all_s']:>11.3f} {pred['exposed_sync_s']:>6.3f} "
              f"{a2a_mb:>13.1f} + {sync_mb:>4.1f} = {a2a_mb + sync_mb:>5.1f}{'':>10} {tx:>16.1f}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plan_time_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--rates", default="100mbit,300mbit,none", help="comma-separated tc rates; none = no limit")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="runs/plan-time-check")
    ap.add_argument("--from", dest="source", default=None, metavar="JSON",
                    help="no runs: predict again for the measurements of an earlier plan_time_check.json "
                         "(written again to --out)")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    args.out = os.path.abspath(args.out)
    if args.source:
        with open(args.source) as f:
            result = json.load(f)
        args.config, args.overrides, args.steps = result["config"], result["overrides"], result["steps"]
        rates = [row["rate"] for row in result["table"]]
        result["table"] = []
        compare(args, result, rates)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "plan_time_check.json"), "w") as f:
            json.dump(result, f, indent=2)
        return 0
    os.makedirs(args.out, exist_ok=True)
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    result = {"config": args.config, "overrides": args.overrides, "steps": args.steps, "warmup": args.warmup,
              "alpha_s": ALPHA_S, "host": socket.gethostname(), "rounds": []}
    if "none" in rates:
        result["unlimited_gbps"] = unlimited_gbps()
        print(f"node-to-node TCP throughput, no limit: {result['unlimited_gbps']:.2f} Gbit/s", flush=True)
    for r in range(args.rounds):
        rnd = {"one_node_s": run_one_node(args, f"r{r}-1node")}
        print(f"round {r}: 1 node x 4: {rnd['one_node_s']:.3f} s/step", flush=True)
        for rate in rates:
            rnd[rate] = run_two_nodes(args, f"r{r}-{rate}", None if rate == "none" else rate)
            print(f"round {r}: 2 nodes x 2, {rate}: {rnd[rate]['step_s']:.3f} s/step", flush=True)
        result["rounds"].append(rnd)
    compare(args, result, rates)
    with open(os.path.join(args.out, "plan_time_check.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
