"""Inter-node bytes and time of one MoE layer, flat vs hierarchical dispatch, on the namespace cluster.

Root (network namespaces): 2 nodes x 2 ranks (tests/helpers/cluster/), the link between the
nodes optionally rate-limited. Every rank runs the same layer (``d_model`` = ``d_ff``, ``E`` experts,
top-``k``, dropless, ``ep=4``) on its own random tokens with each dispatch, twice, alternating (flat,
hierarchical, flat, hierarchical); each round is a warm-up forward + backward, then ``iters`` timed
ones between barriers, with node0's ``eth0`` counters read around them. Prints per round the bytes
that crossed (node0's received + sent), the rows the layers counted (``MoELayer.inter_node_rows``,
summed over ranks), the payload those rows make (4 transfers of ``d`` floats per row: rows out,
outputs back, and both again in the backward; the hierarchical rows carry ``2k`` numbers more, out
and back), and the seconds per forward + backward (the slowest rank).

    sudo .venv/bin/python -m benchmarks.hierarchical_bytes [--rate 50mbit] [--d 512] [--tokens 256] [--experts 8] [--k 4] [--iters 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout (benchmarks/ is at its top)
NODES, PER_NODE = 2, 2
MODES = ("flat", "hierarchical", "flat", "hierarchical")
WORKER = "MOE_DIST_HIERARCHICAL_BYTES_WORKER"


def _link() -> tuple[int, int]:
    base = "/sys/class/net/eth0/statistics/"
    with open(base + "rx_bytes") as rx, open(base + "tx_bytes") as tx:
        return int(rx.read()), int(tx.read())


def worker(d: int, tokens: int, experts: int, k: int, iters: int) -> None:
    """One rank (started by torchrun inside a node): prints the rounds' figures on the node's first rank."""
    import torch
    import torch.distributed as dist

    from moe_dist.distributed import build_parallel_groups
    from moe_dist.moe import MoEArgs, MoELayer
    from moe_dist.parallel import apply_expert_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node_of = [r // PER_NODE for r in range(world)]
    rounds = []
    for mode in MODES:
        groups = build_parallel_groups(world, experts, node_of=node_of, dispatch=mode)
        torch.manual_seed(0)
        layer = apply_expert_parallel(MoELayer(d, MoEArgs(d_ff=d, num_experts=experts, top_k=k)), groups)
        x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(rank + 1)).requires_grad_()
        layer(x).sum().backward()  # warm-up
        dist.barrier()
        before, start = _link(), time.perf_counter()
        pairs = rows = 0
        for _ in range(iters):
            layer(x).sum().backward()
            pairs, rows = pairs + layer.inter_node_rows[0], rows + layer.inter_node_rows[1]
        dist.barrier()
        seconds = torch.tensor([(time.perf_counter() - start) / iters])
        after = _link()
        counts = torch.tensor([pairs, rows])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        dist.all_reduce(counts)
        rounds.append({"mode": mode, "hierarchical": layer.hierarchical, "bytes": after[0] - before[0] + after[1] - before[1],
                       "pairs": int(counts[0]), "rows": int(counts[1]), "s_per_iter": float(seconds)})
    if rank == 0:
        print("RESULT " + json.dumps(rounds), flush=True)
    dist.destroy_process_group()


def payload(r: dict, d: int, k: int) -> int:
    """The bytes the counted rows make (fp32): 4 transfers of a row, plus the ids and gates (out and back)."""
    return 4 * r["rows"] * d * 4 + (2 * r["rows"] * 2 * k * 4 if r["hierarchical"] else 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default=None, help="tc rate of the link between the nodes (none: unlimited)")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    a = ap.parse_args()
    if os.environ.get(WORKER):  # a rank, started by torchrun below (its options come in WORKER)
        worker(*json.loads(os.environ[WORKER]))
        return 0
    from tests.helpers.cluster import Cluster

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="eth0",
               **{WORKER: json.dumps([a.d, a.tokens, a.experts, a.k, a.iters])})
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    with Cluster(NODES, rate=a.rate) as c, tempfile.TemporaryDirectory() as tmp:
        procs = []
        for i in range(NODES):
            out = open(os.path.join(tmp, f"node{i}.out"), "w+")
            argv = [torchrun, f"--nnodes={NODES}", f"--nproc-per-node={PER_NODE}", f"--node-rank={i}",
                    "--master-addr=node0", "--master-port=29533", "-m", "benchmarks.hierarchical_bytes"]
            procs.append((c.popen(c.nodes[i], argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT), out))
        for p, _ in procs:
            p.wait(timeout=900)
        p, out = procs[0]
        out.seek(0)
        text = out.read()
        for _, f in procs:
            f.close()
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if p.returncode or not lines:
        print(text[-4000:], file=sys.stderr)
        return 1
    print(f"link {a.rate or 'unlimited'}, d={a.d}, {a.tokens} tokens per rank, E={a.experts}, k={a.k}, "
          f"{NODES} nodes x {PER_NODE} ranks, {a.iters} forward+backward per round")
    print(f"{'dispatch':<13} {'rows':>7} {'pairs':>7} {'bytes':>11} {'payload':>11} {'ratio':>6} {'s/iter':>7}")
    for r in json.loads(lines[0][len("RESULT "):]):
        pay = payload(r, a.d, a.k)
        name = r["mode"] if r["hierarchical"] or r["mode"] == "flat" else r["mode"] + " (fell back)"
        print(f"{name:<13} {r['rows']:>7} {r['pairs']:>7} {r['bytes']:>11} {pay:>11} {r['bytes'] / pay:>6.3f} "
              f"{r['s_per_iter']:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
