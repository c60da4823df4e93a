"""A node with two interfaces whose default one cannot reach the other nodes (the namespace cluster
of tests/helpers/cluster/; the rule: moe_dist/distributed/interfaces.py).

node0 gets a second interface, ``eth1`` (10.213.2.1), that holds its default route and to which its
own host name resolves on node0 (node1 resolves ``node0`` to its ``eth0`` address); ``MASTER_ADDR`` is
node1. gloo listens on the address its host name resolves to, and of two ranks the one with the
higher listening address connects to the other's: node1 (10.213.27.2) connects to 10.213.2.1 and
never gets there.

* gloo alone (a plain ``init_process_group``) fails only when its timeout has passed;
* ``launch/torchrun.sh`` trains: every rank takes the interface of its route to the rendezvous
  (``eth0``), named in the ``parallel:`` line; nothing leaves node0 through ``eth1``;
* ``GLOO_SOCKET_IFNAME`` naming a missing interface, or ``eth1`` (which cannot reach node1): node0
  ends with one line and exit code 2 within seconds, before its process group starts.

Needs root and ``ip netns``; skipped with the reason elsewhere.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from helpers.multinode_harness import ROOT, _env, up_or_skip
from helpers.cluster import Cluster

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

RUN_TIMEOUT = 300  # one launch on a busy 2-core machine
QUIET = ["train.steps=2", "parallel.ep=2", "run.progress=false", "run.plots=false", "run.tensorboard=false",
         "ckpt.save_final=false", "eval.max_sequences=8"]


@pytest.fixture(scope="module")
def cluster():
    yield from up_or_skip(lambda c: c.add_second_interface(c.nodes[0]))


@pytest.fixture(autouse=True)
def _clean_nodes(cluster):
    cluster.allow_forwarding()  # a dockerd started meanwhile sets the FORWARD policy to DROP
    yield
    for nd in cluster.nodes:
        cluster.kill_node(nd)


def _tx(c: Cluster, node, dev: str) -> int:
    return int(c.run(node, ["cat", f"/sys/class/net/{dev}/statistics/tx_bytes"]).stdout)


def test_the_second_interface_holds_the_default_route_and_the_node_s_name(cluster):
    c = cluster
    routes = c.run(c.nodes[0], ["ip", "-o", "route", "show"]).stdout
    assert "default dev eth1" in routes, routes
    assert c.run(c.nodes[0], ["getent", "hosts", "node0"]).stdout.split() == ["10.213.2.1", "node0"]
    assert c.run(c.nodes[1], ["getent", "hosts", "node0"]).stdout.split() == ["10.213.27.1", "node0"]


PLAIN = textwrap.dedent("""
    import datetime, sys, time, torch, torch.distributed as dist
    rank, t0 = int(sys.argv[1]), time.monotonic()
    store = dist.TCPStore("node1", 29623, 2, is_master=rank == 1, timeout=datetime.timedelta(seconds=60))
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=10))
        t = torch.ones(1)
        dist.all_reduce(t)
        print("all_reduce", t.item())
    except RuntimeError as e:
        print("failed after %.0f s: %s" % (time.monotonic() - t0, str(e).splitlines()[0]))
""")


def test_gloo_alone_listens_on_the_name_s_interface_and_waits_for_its_timeout(cluster):
    c = cluster
    procs = [c.popen(nd, [sys.executable, "-c", PLAIN, str(i)], env=_env(), stdout=subprocess.PIPE,
                     stderr=subprocess.DEVNULL, text=True) for i, nd in enumerate(c.nodes)]
    outs = [p.communicate(timeout=RUN_TIMEOUT)[0] for p in procs]
    print(outs)
    assert all("failed after" in out and "all_reduce" not in out for out in outs), outs
    # node1 cannot reach node0's gloo address (10.213.2.1); node0 waits for node1 until the 10 s timeout
    assert "Network is unreachable" in outs[1] and "Connect timeout" in outs[0], outs
    assert int(outs[0].split("failed after ")[1].split()[0]) >= 10, outs


def _launch(c: Cluster, tmp, name: str, envs: list[dict], *overrides, timeout: float = RUN_TIMEOUT, first_only=False):
    """launch/torchrun.sh on both nodes (1 process each, MASTER_ADDR=node1); [(rc, out, err, seconds)]
    (``first_only``: node0's, and node1 is stopped once node0 has ended)."""
    procs, rdzv, t0 = [], f"{name}-{time.time_ns()}", time.monotonic()
    for i, extra in enumerate(envs):
        env = _env(NPROC_PER_NODE="1", NNODES="2", NODE_RANK=str(i), MASTER_ADDR="node1", RDZV_ID=rdzv, **extra)
        procs.append(c.popen(c.nodes[i], ["bash", "launch/torchrun.sh", "configs/test.yaml", f"run.dir={tmp}/{name}",
                                          f"data.cache_dir={tmp}/cache", *QUIET, *overrides],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        results.append((p.returncode, out, err, time.monotonic() - t0))
        if first_only:
            c.kill_node(c.nodes[1])
            procs[1].communicate()
            return results
    return results


def test_the_rule_takes_the_interface_of_the_route_to_the_rendezvous(cluster, tmp_path):
    c = cluster
    before = _tx(c, c.nodes[0], "eth1")
    results = _launch(c, tmp_path, "rule", [{}, {}], "parallel.timeout_s=60")
    for i, (rc, out, err, _) in enumerate(results):
        assert rc == 0, f"node{i} exited {rc}:\n{out[-2000:]}\n{err[-3000:]}"
    line = [ln for rc, out, err, _ in results for ln in out.splitlines() if ln.startswith("parallel:")]
    assert len(line) == 1 and "[torchrun, gloo over eth0 (route to node1)," in line[0], line
    assert _tx(c, c.nodes[0], "eth1") == before  # nothing went the default way
    print(f"2 nodes, node0 with a second default interface: trained in {results[0][3]:.0f} s")


def test_a_wrong_gloo_socket_ifname_is_one_line_before_the_process_group(cluster, tmp_path):
    c = cluster
    for name, iface, says in (("missing", "eth9", "GLOO_SOCKET_IFNAME=eth9: there is no interface 'eth9' on node0 "
                                                   "(its interfaces: eth0, eth1, eth1-end, lo)"),
                              ("unreachable", "eth1", "GLOO_SOCKET_IFNAME=eth1: interface eth1 (10.213.2.1) on node0 "
                                                      "cannot reach MASTER_ADDR=node1 (10.213.27.2:29500): no answer "
                                                      "within 5 s")):
        procs_env = [{"GLOO_SOCKET_IFNAME": iface}, {}]
        # node1 would wait for node0 at its process group's start until parallel.timeout_s: stopped
        rc, out, err, seconds = _launch(c, tmp_path, name, procs_env, first_only=True)[0]
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("W1", "[W"))]
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("moe-dist train: error: " + says), (rc, out, err)
        print(f"GLOO_SOCKET_IFNAME={iface} on node0: exit 2 after {seconds:.0f} s: {lines[0]}")
