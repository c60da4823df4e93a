"""The counted inter-node all-to-all bytes against the nodes' links (benchmarks/a2a_bytes.py): 2
namespace nodes x 2 ranks, one MoE layer at ep=4 called forward + backward and nothing else; what
each node's eth0 sent beyond an idle window is the bytes its ranks counted plus the transport's
overhead, which stays within the bounds explained in docs/namespace-cluster.md and measured in
benchmarks/results/dispatch.md.

Needs root and ``ip netns``; skipped with the reason elsewhere.
"""
from __future__ import annotations

import json
import sys
import time

import pytest

from helpers.multinode_harness import ROOT, _clean_nodes, _env, cluster, finish  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

CALLS = 6
# what a node's link carries beyond the counted payload and its packets' headers (66 bytes each): the
# routing statistics' all-gather and gloo's message headers, measured at 3.5-4.5 KB per layer call
# (benchmarks/results/dispatch.md, "All-to-all bytes: counted, against the links"); nothing may be missing (other >= 0)
OTHER_PER_CALL = 8_000
IDLE = 8_000  # the idle window's own two barriers and reads


def run_bench(c, tmp, *args) -> dict:
    procs, rdzv = [], f"a2a-{time.time_ns()}"
    out_file = tmp / "a2a.json"
    for i, nd in enumerate(c.nodes):
        env = _env(MOE_DIST_RENDEZVOUS="node0:29511")
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={i}", "--nproc-per-node=2",
                "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29511", f"--rdzv-id={rdzv}",
                "-m", "benchmarks.a2a_bytes", "--calls", str(CALLS), "--out", str(out_file), *args]
        out, err = open(tmp / f"node{i}.out", "w+"), open(tmp / f"node{i}.err", "w+")
        procs.append((c.popen(nd, argv, env=env, cwd=ROOT, stdout=out, stderr=err), out, err))
    deadline = time.monotonic() + 120
    results = [finish(p, deadline - time.monotonic()) for p in procs]
    for i, (rc, out, err) in enumerate(results):
        assert rc == 0, f"node{i} exited {rc}:\n{out[-3000:]}\n{err[-3000:]}"
    return json.loads(out_file.read_text())


def test_counted_inter_node_bytes_match_the_links(cluster, tmp_path):
    # dropless rows of 64 and 512 fp32 values through the pipelined exchange, and 512 with a capacity (its
    # count exchange) through the exchange-then-compute kernels
    res = run_bench(cluster, tmp_path, "--layers", "64", "512", "512:bmm:1.0")
    for w in res["windows"]:
        print(w["calls_of"], w["d_model"], w["kernel"], w["capacity_factor"],
              {n: {k: v[k] for k in ("counted_sent", "sent", "tx_packets", "other_sent_per_call", "sent_over_counted")}
               for n, v in w["nodes"].items()})
    for n, idle in res["idle"].items():
        assert 0 < idle["tx_bytes"] < IDLE, (n, idle)
    for w in res["windows"]:
        for n, node in w["nodes"].items():
            what = (w["calls_of"], w["d_model"], w["kernel"], n)
            assert node["counted_sent"] > 100_000, what  # the payload dominates the window
            assert 0 <= node["other_sent"] <= OTHER_PER_CALL * CALLS, (what, node)
            assert 0 <= node["other_received"] <= OTHER_PER_CALL * CALLS, (what, node)


def test_hierarchical_dispatch_bytes_match_the_links(cluster, tmp_path):
    # top-4 of 8 experts on 2 nodes: the hierarchical dispatch sends each token to the other node once (its
    # rows with their ids and gates counted as such); the flat one sends a row per pair there
    flat = run_bench(cluster, tmp_path, "--layers", "512", "--top-k", "4")
    hier = run_bench(cluster, tmp_path, "--layers", "512", "--top-k", "4", "--dispatch", "hierarchical")
    assert hier["dispatch"] == "hierarchical" and [w["calls_of"] for w in hier["windows"]] == ["layer"]
    for n, node in hier["windows"][0]["nodes"].items():
        assert 0 <= node["other_sent"] <= OTHER_PER_CALL * CALLS, (n, node)
        assert 0 <= node["other_received"] <= OTHER_PER_CALL * CALLS, (n, node)
        assert node["counted_sent"] < 0.6 * flat["windows"][0]["nodes"][n]["counted_sent"], (n, node)
