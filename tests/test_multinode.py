"""Several nodes on one machine (moe_dist/testing/cluster.py: network namespaces on a bridge, each
with its own address, host name and hosts file), and the project's launcher across them.

* the cluster: every node has its name, resolves the others, reaches them only over its own link
  and nothing outside; it is removed again after an exception and after a crashed owner;
* ``launch/torchrun.sh`` on 2 nodes x 2 processes (``parallel.ep=4``: every MoE layer's experts
  span both nodes) gives the losses of 1 process on the whole batch (1e-5), and so do 2 nodes x 1
  process meeting at ``MASTER_ADDR=node0`` (a host name);
* the traffic: a 2-node run moves what FSDP and the token all-to-alls must carry over the nodes'
  links, a 1-node run (both ranks on one node) moves nothing over them.

Needs root and ``ip netns``; skipped with the reason elsewhere.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from moe_dist.testing.cluster import Cluster, ClusterUnavailable, recorded_clusters, remove_stale, unavailable_reason

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUIET = ["run.progress=false", "run.plots=false", "run.tensorboard=false", "ckpt.save_final=false",
         "eval.max_sequences=8"]
STEPS = 4
RUN_TIMEOUT = 240  # one launch on a busy 2-core machine: ~20-40 s alone


@pytest.fixture(scope="module")
def cluster():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    remove_stale()
    with Cluster(2) as c:
        yield c


@pytest.fixture(autouse=True)
def _clean_nodes(request):
    """After every test: no process left on a node, every link plugged in (also after a failure)."""
    yield
    if "cluster" in request.fixturenames:
        c = request.getfixturevalue("cluster")
        for nd in c.nodes:
            c.kill_node(nd)
            c.set_link(nd, True)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK")}
    env.update(PYTHON=sys.executable, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", **extra)
    return env


def _config(tmp, name, *extra) -> list[str]:
    return ["configs/test.yaml", f"run.dir={tmp}/{name}", f"data.cache_dir={tmp}/cache",
            f"train.steps={STEPS}", *QUIET, *extra]


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def launch_nodes(c: Cluster, tmp, name: str, nodes: int, nproc: int, *overrides, master="node0"):
    """``launch/torchrun.sh`` on the first ``nodes`` nodes; waits; returns [(rc, out, err)] per node."""
    procs, rdzv_id = [], f"{name}-{time.time_ns()}"
    for i in range(nodes):
        env = _env(NPROC_PER_NODE=str(nproc), NNODES=str(nodes), NODE_RANK=str(i), MASTER_ADDR=master,
                   RDZV_ID=rdzv_id)
        out = open(tmp / f"{name}.node{i}.out", "w+")
        err = open(tmp / f"{name}.node{i}.err", "w+")
        procs.append((c.popen(c.nodes[i], ["bash", "launch/torchrun.sh", *_config(tmp, name, *overrides)], env=env,
                              cwd=ROOT, stdout=out, stderr=err), out, err))
    deadline = time.monotonic() + RUN_TIMEOUT
    results = []
    for p, out, err in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        out.seek(0)
        err.seek(0)
        results.append((p.returncode, out.read(), err.read()))
    return results


def _assert_ok(results):
    for i, (rc, out, err) in enumerate(results):
        assert rc == 0, f"node{i} exited {rc}:\n{out[-3000:]}\n{err[-3000:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The loss curve of 1 process on the whole batch (``parallel.ep=1``), in the root namespace."""
    tmp = tmp_path_factory.mktemp("reference")
    res = subprocess.run([sys.executable, "-m", "moe_dist.cli", "train", "--config",
                          *_config(tmp, "one", "parallel.ep=1")], cwd=ROOT, env=_env(), capture_output=True,
                         text=True, timeout=RUN_TIMEOUT)
    assert res.returncode == 0, res.stdout + res.stderr
    losses = _losses(tmp / "one")
    assert len(losses) == STEPS and losses[-1] < losses[0]
    return losses


def _python_on(c, node, code, **kw):
    return c.run(node, [sys.executable, "-c", textwrap.dedent(code)], env=_env(), timeout=60, **kw)


def test_nodes_have_their_names_and_reach_each_other_only_over_their_links(cluster):
    c = cluster
    for nd in c.nodes:
        r = c.run(nd, ["hostname"])
        assert r.returncode == 0 and r.stdout.strip() == nd.hostname, r.stderr
        r = c.run(nd, ["getent", "hosts", *(m.hostname for m in c.nodes)])
        assert r.stdout.split() == [w for m in c.nodes for w in (m.address, m.hostname)], r.stdout + r.stderr
        routes = c.run(nd, ["ip", "-o", "route", "show"]).stdout
        assert "default" not in routes and f"dev eth0" in routes  # nothing leaves the machine
    # a TCP connection from node1 to node0 by name, counted on both links
    server = c.popen(c.nodes[0], [sys.executable, "-c", textwrap.dedent("""
        import socket
        s = socket.create_server(("0.0.0.0", 28711)); print("ready", flush=True)
        conn, addr = s.accept(); n = 0
        while True:
            b = conn.recv(65536)
            if not b: break
            n += len(b)
        print(n, addr[0], flush=True)""")], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        before = [c.link_bytes(nd) for nd in c.nodes]
        r = _python_on(c, c.nodes[1], """
            import socket
            with socket.create_connection(("node0", 28711), timeout=20) as s:
                s.sendall(b"x" * 1_000_000)""")
        assert r.returncode == 0, r.stderr
        out = server.communicate(timeout=30)[0].split()
    finally:
        server.kill()
    assert out == ["1000000", c.nodes[1].address]
    rx0 = c.link_bytes(c.nodes[0])[0] - before[0][0]
    tx1 = c.link_bytes(c.nodes[1])[1] - before[1][1]
    assert 1_000_000 < rx0 < 1_100_000 and 1_000_000 < tx1 < 1_100_000, (rx0, tx1)  # payload + TCP/IP headers


def test_a_cluster_is_removed_after_an_exception_and_after_its_owner_died():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with pytest.raises(KeyError):
        with Cluster(1, rate="200mbit") as c:
            names = [nd.netns for nd in c.nodes] + [c.bridge]
            assert c.run(c.nodes[0], ["tc", "qdisc", "show", "dev", "eth0"]).stdout.startswith("qdisc tbf")
            c.node("node7")
    assert not _leftovers(names)
    # a cluster whose owner process died (a crashed test run) is found and removed
    code = f"""
        import os
        from moe_dist.testing.cluster import Cluster
        c = Cluster(1); c.up(); print(c.prefix, flush=True); os._exit(0)"""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=_env(), capture_output=True, text=True,
                       timeout=60)
    prefix = r.stdout.strip()
    assert r.returncode == 0 and prefix in [st["prefix"] for st in recorded_clusters()], r.stderr
    assert prefix in remove_stale()
    assert not _leftovers([f"{prefix}-node0", f"{prefix}-br"]) and not os.path.exists(f"/etc/netns/{prefix}-node0")


def _leftovers(names):
    have = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout + \
        subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return [n for n in names if n in have]


def test_cluster_refuses_clearly_without_root():
    if os.geteuid() != 0:
        assert "needs root" in unavailable_reason()
        with pytest.raises(ClusterUnavailable, match="needs root"):
            Cluster(2).up()
        return
    # as root: the same check run by an unprivileged user (nobody)
    code = "from moe_dist.testing.cluster import main; raise SystemExit(main(['up', '2']))"
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                       env=_env(), capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 2 and r.stderr.strip() == "cluster: a namespace cluster needs root (ip netns, veth, bridge)", \
        r.stdout + r.stderr


def test_torchrun_on_two_nodes_of_two_processes_matches_one_process(cluster, reference, tmp_path):
    c = cluster
    before = [c.link_bytes(nd) for nd in c.nodes]
    results = launch_nodes(c, tmp_path, "ep4", 2, 2, "parallel.ep=4")
    _assert_ok(results)
    moved = [sum(c.link_bytes(nd)) - sum(b) for nd, b in zip(c.nodes, before)]
    out = results[0][1]
    assert "parallel: 4 process(es) [torchrun, gloo" in out and "ep=4" in out, out
    assert out.count(f"done: {STEPS} steps") == 1 and results[1][1].count("done:") == 0
    info = json.load(open(tmp_path / "ep4" / "run.json"))
    assert (info["world_size"], info["ep"]) == (4, 4)
    losses = _losses(tmp_path / "ep4")
    assert losses == pytest.approx(reference, rel=1e-5, abs=0)
    assert min(moved) > 1_000_000, moved  # the experts of every layer span both nodes


def dense_parameter_bytes(run_dir) -> int:
    """fp32 bytes of the dense (FSDP-sharded) weights: total minus the experts'. From run.json's counts:
    the active count has top_k of each layer's num_experts experts."""
    info = json.load(open(os.path.join(run_dir, "run.json")))
    from moe_dist.config import load_config

    conf = load_config(os.path.join(run_dir, "config.yaml"))
    moe = conf.model.moe
    layers = conf.model.n_layers  # configs/test.yaml: moe.layers=every
    total, active = info["parameters"]["total"], info["parameters"]["active"]
    per_expert = (total - active) // (layers * (moe.num_experts - moe.top_k))
    return 4 * (total - layers * moe.num_experts * per_expert)


def test_two_nodes_meet_at_a_host_name_and_carry_the_inter_node_traffic(cluster, reference, tmp_path):
    c = cluster
    before = [c.link_bytes(nd) for nd in c.nodes]
    results = launch_nodes(c, tmp_path, "ep2", 2, 1, "parallel.ep=2", master="node0")
    _assert_ok(results)
    after = [c.link_bytes(nd) for nd in c.nodes]
    assert _losses(tmp_path / "ep2") == pytest.approx(reference, rel=1e-5, abs=0)
    rx = [a[0] - b[0] for a, b in zip(after, before)]
    tx = [a[1] - b[1] for a, b in zip(after, before)]
    # one link's two ends: what node1 sends, node0 receives (the bridge adds nothing)
    assert rx[0] == tx[1] and rx[1] == tx[0], (rx, tx)
    # what must cross per step at the least: FSDP gathers the other rank's half of the dense weights
    # (forward) and sends it its half of their gradients (reduce-scatter), each way
    dense = dense_parameter_bytes(tmp_path / "ep2")
    least = STEPS * dense
    # at the most: the dense weights gathered twice (forward, backward) and their gradients, and every
    # routed token's vector crossing in the 4 all-to-alls of each MoE layer (dispatch, combine, and
    # their gradients), for the training steps and one evaluation batch; x2 for TCP/IP and control
    tokens = 8 * 64 // 2 * 2  # the batch's tokens on one rank x top_k
    a2a = 4 * 2 * tokens * 64 * 4
    most = 2 * ((STEPS + 1) * (1.5 * dense + a2a) + 3 * dense)  # + the initial broadcast of the weights
    for moved in rx + tx:
        assert least < moved < most, (least, moved, most)


def test_one_node_run_moves_nothing_over_the_links(cluster, reference, tmp_path):
    c = cluster
    before = [c.link_bytes(nd) for nd in c.nodes]
    results = launch_nodes(c, tmp_path, "onenode", 1, 2, "parallel.ep=2", master="node0")
    _assert_ok(results)
    moved = [sum(c.link_bytes(nd)) - sum(b) for nd, b in zip(c.nodes, before)]
    assert _losses(tmp_path / "onenode") == pytest.approx(reference, rel=1e-5, abs=0)
    assert moved == [0, 0], moved  # both ranks talk over node0's loopback
