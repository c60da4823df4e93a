"""Several nodes on one machine (tests/helpers/cluster/: network namespaces on a bridge, each
with its own address, host name and hosts file), and the project's launcher across them.

* the cluster: every node has its name, resolves the others, reaches them only over its own link
  and nothing outside; it is removed again after an exception and after a crashed owner;
* ``launch/torchrun.sh`` on 2 nodes x 2 processes (``parallel.ep=4``: every MoE layer's experts
  span both nodes) gives the losses of 1 process on the whole batch (1e-5), and moves what FSDP
  and the token all-to-alls must carry over the nodes' links;
* a node lost mid-run (its processes killed; its link unplugged): the surviving rank ends with one
  line naming the lost node and its ranks, nothing is half-saved; a run of 2 nodes x 1 process
  that met at ``MASTER_ADDR=node0`` (a host name) and lost node1 continues with ``resume=auto`` on
  node0 alone (2 processes) on the uninterrupted run's loss curve, moving nothing over the links.

Needs root and ``ip netns``; skipped with the reason elsewhere.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from helpers.cluster import Cluster, ClusterUnavailable, recorded_clusters, remove_stale, unavailable_reason
from helpers.run_dir import assert_curve_matches, metrics_rows
from helpers.multinode_harness import (ROOT, RUN_TIMEOUT, STEPS, _clean_nodes, _config, _env, _one_rank_line,  # noqa: F401 (fixtures)
                               cluster, finish, start_node, start_nodes)

pytestmark = [pytest.mark.multinode, pytest.mark.slow]


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def launch_nodes(c: Cluster, tmp, name: str, nodes: int, nproc: int, *overrides, master="node0"):
    """``launch/torchrun.sh`` on the first ``nodes`` nodes; waits; returns [(rc, out, err)] per node."""
    procs = start_nodes(c, tmp, name, nodes, nproc, *overrides, master=master)
    deadline = time.monotonic() + RUN_TIMEOUT
    return [finish(p, deadline - time.monotonic()) for p in procs]


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
        assert "default" not in routes and "dev eth0" in routes  # nothing leaves the machine
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
    code = """
        import os
        from tests.helpers.cluster import Cluster
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
    code = "from tests.helpers.cluster.__main__ import main; raise SystemExit(main(['up', '2']))"
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                       env=_env(), capture_output=True, text=True, timeout=60, cwd="/")
    assert r.returncode == 2 and r.stderr.strip() == "cluster: a namespace cluster needs root (ip netns, veth, bridge)", \
        r.stdout + r.stderr


def dense_parameter_bytes(run_dir) -> int:
    """fp32 bytes of the dense (FSDP-sharded) weights: all but the experts. run.json counts the
    parameters in total and those active per token (top_k of each MoE layer's num_experts experts)."""
    from moe_dist.config import load_config

    info = json.load(open(os.path.join(run_dir, "run.json")))
    conf = load_config(os.path.join(run_dir, "config.yaml"))
    moe, layers = conf.model.moe, conf.model.n_layers  # configs/test.yaml: an MoE block in every layer
    total, active = info["parameters"]["total"], info["parameters"]["active"]
    per_expert = (total - active) // (layers * (moe.num_experts - moe.top_k))
    return 4 * (total - layers * moe.num_experts * per_expert)


def test_torchrun_on_two_nodes_of_two_processes_matches_one_process(cluster, reference, tmp_path):
    c = cluster
    before = [c.link_bytes(nd) for nd in c.nodes]
    results = launch_nodes(c, tmp_path, "ep4", 2, 2, "parallel.ep=4")
    _assert_ok(results)
    after = [c.link_bytes(nd) for nd in c.nodes]
    out = results[0][1]
    assert "parallel: 4 process(es) [torchrun, gloo" in out and "ep=4" in out, out
    assert out.count(f"done: {STEPS} steps") == 1 and results[1][1].count("done:") == 0
    info = json.load(open(tmp_path / "ep4" / "run.json"))
    assert (info["world_size"], info["ep"]) == (4, 4)
    assert _losses(tmp_path / "ep4") == pytest.approx(reference, rel=1e-5, abs=0)

    # the inter-node traffic: one link's two ends agree (what node1 sends, node0 receives)
    rx = [a[0] - b[0] for a, b in zip(after, before)]
    tx = [a[1] - b[1] for a, b in zip(after, before)]
    assert rx[0] == tx[1] and rx[1] == tx[0], (rx, tx)
    # at the least, each step, whatever the algorithms: a node receives the other node's half of the
    # dense weights (FSDP's all-gather) and its partial gradients of this node's half (reduce-scatter)
    dense = dense_parameter_bytes(tmp_path / "ep4")
    least = STEPS * dense
    # at the most: per step the dense weights gathered twice (forward, backward; every remote shard to
    # each of the 2 local ranks) and their gradients reduced (as an all-reduce: twice), and every routed
    # token of the node's ranks crossing in each MoE layer's 4 all-to-alls (dispatch, combine and their
    # gradients); the same for one evaluation batch, the start-up broadcast; x2 for TCP/IP and control
    tokens = 8 * 64 // 2 * 2  # the node's tokens (half the global batch) x top_k
    a2a = 4 * 2 * tokens * 64 * 4
    most = 2 * ((STEPS + 1) * (4 * dense + a2a) + 3 * dense)
    print(f"2 nodes x 2 processes, ep=4, {STEPS} steps: node0 received {rx[0]:,} and sent {tx[0]:,} bytes "
          f"(bounds {least:,}..{most:,})")
    for moved in rx + tx:
        assert least < moved < most, (least, moved, most)


# A run that outlives the kill: constant learning rate after the warm-up (min_lr_ratio=1), so that its
# curve does not depend on train.steps and a short uninterrupted run is its reference
LOST = ["parallel.ep=2", "train.min_lr_ratio=1", "ckpt.every=5", "ckpt.verify=false"]
LOST_STEPS, RESUMED_STEPS = 3000, 12


def _wait_for_step(run_dir, step: int, procs, timeout: float = RUN_TIMEOUT) -> None:
    deadline, path = time.monotonic() + timeout, os.path.join(run_dir, "metrics.jsonl")
    while time.monotonic() < deadline:
        if os.path.exists(path) and sum(1 for _ in open(path)) >= step:
            return
        assert all(p.poll() is None for p, _, _ in procs), "a node's launcher ended before the step"
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached within {timeout} s")


def _checkpoints_complete(run_dir) -> list[str]:
    """The checkpoints, each complete: nothing half-saved passes for a checkpoint. A save that the
    failure interrupted stays step_N.partial (resume=auto removes it, docs/operations.md)."""
    where = os.path.join(run_dir, "checkpoints")
    names = sorted(os.listdir(where)) if os.path.isdir(where) else []
    done = [n for n in names if not n.endswith(".partial")]
    assert all(re.fullmatch(r"step_\d{6}", n) and os.path.exists(os.path.join(where, n, "COMPLETE")) for n in done), names
    return done


def test_a_killed_node_is_named_and_the_run_resumes_on_the_other_node(cluster, tmp_path):
    c = cluster
    procs = start_nodes(c, tmp_path, "lost", 2, 1, *LOST, f"train.steps={LOST_STEPS}")
    _wait_for_step(tmp_path / "lost", 7, procs)  # past the checkpoint of step 5
    t0 = time.monotonic()
    c.kill_node(c.nodes[1])  # every process of node1, as if the machine died
    rc, out, err = finish(procs[0], 120)
    seconds = time.monotonic() - t0
    finish(procs[1], 5)
    assert rc == 1, out[-2000:] + err[-4000:]
    line = _one_rank_line(err)
    assert line.startswith("moe-dist train: rank 0: the collective ") and "another rank went away" in line, line
    assert line.endswith("; lost node node1 (rank 1): none of its ranks answered a roll call within 10 s"), line
    assert seconds < 60, seconds  # a connection reset: no waiting for parallel.timeout_s
    print(f"killed node: the survivor ended {seconds:.1f} s after the kill")
    names = _checkpoints_complete(tmp_path / "lost")
    assert names, "no checkpoint"
    before_kill = metrics_rows(tmp_path / "lost")

    # resume=auto on the remaining node alone (2 processes, same global batch): the same loss curve as an
    # uninterrupted run, and nothing crosses the links (both ranks talk over node0's loopback)
    ref = subprocess.run([sys.executable, "-m", "moe_dist.cli", "train", "--config",
                          *_config(tmp_path, "uninterrupted", *LOST, "parallel.ep=1", f"train.steps={RESUMED_STEPS}")],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    before = [c.link_bytes(nd) for nd in c.nodes]
    (rc, out, err), = launch_nodes(c, tmp_path, "lost", 1, 2, *LOST, f"train.steps={RESUMED_STEPS}", "resume=auto")
    assert rc == 0, out[-2000:] + err[-4000:]
    moved = [sum(c.link_bytes(nd)) - sum(b) for nd, b in zip(c.nodes, before)]
    assert moved == [0, 0], moved
    start = int(names[-1].split("_")[1])
    assert f"checkpoints/{names[-1]} at step {start} (saved by 2 rank(s)" in out, out[-2000:]
    rows = metrics_rows(tmp_path / "lost")
    resumed = rows[-(RESUMED_STEPS - start):]
    assert [r["step"] for r in resumed] == list(range(start + 1, RESUMED_STEPS + 1)), [r["step"] for r in rows]
    uninterrupted = metrics_rows(tmp_path / "uninterrupted")
    # 2 nodes x 1 process that met at MASTER_ADDR=node0 (a host name), then 1 node x 2 processes: one curve,
    # that of 1 process (to rounding, until a near tie of two experts goes the other way, if one does)
    n = min(len(before_kill), RESUMED_STEPS)
    assert_curve_matches(before_kill[:n], uninterrupted[:n])
    assert_curve_matches(before_kill[:start] + resumed, uninterrupted)


def _rank_line_when_written(path, timeout: float = 60) -> str:
    """The one line a node's rank prints when it ends, once it is in the file at ``path``."""
    err, deadline = "", time.monotonic() + timeout
    while "moe-dist train:" not in err and time.monotonic() < deadline:
        time.sleep(0.5)
        err = open(path).read()
    return _one_rank_line(err)


def test_an_unplugged_node_is_named_after_the_collective_timeout(cluster, tmp_path):
    c = cluster
    timeout_s = 12
    procs = start_nodes(c, tmp_path, "unplugged", 2, 1, *LOST, f"train.steps={LOST_STEPS}",
                        f"parallel.timeout_s={timeout_s}")
    _wait_for_step(tmp_path / "unplugged", 3, procs)
    t0 = time.monotonic()
    c.set_link(c.nodes[1], False)  # no connection reset reaches node0: only silence
    rc, out, err = finish(procs[0], timeout_s + 120)
    seconds = time.monotonic() - t0
    assert rc == 1, out[-2000:] + err[-4000:]
    line = _one_rank_line(err)
    assert f"did not complete within parallel.timeout_s={timeout_s} s" in line, line
    assert line.endswith("; lost node node1 (rank 1): none of its ranks answered a roll call within 2 s"), line
    assert timeout_s <= seconds < timeout_s + 60, seconds
    print(f"unplugged node: the survivor ended {seconds:.1f} s after the unplug (parallel.timeout_s={timeout_s})")
    _checkpoints_complete(tmp_path / "unplugged")
    # the unplugged node's rank times out as well and knows that it is the one cut off
    line1 = _rank_line_when_written(tmp_path / "unplugged.node1.err")
    assert line1.startswith("moe-dist train: rank 1: the collective ") and re.search(
        r"; the job's rendezvous store at node0:\d+ cannot be reached either: this node \(node1\) is cut off "
        r"from the others, or node0 is lost$", line1), line1


def test_an_unplugged_node_is_named_within_the_heartbeat_timeout(cluster, tmp_path):
    """The link cut with the collective timeout at its default (600 s): the heartbeat ends both sides
    within seconds, the survivor naming the lost node, the cut-off node saying that it is cut off."""
    c = cluster
    heartbeat_s = 8
    procs = start_nodes(c, tmp_path, "silent", 2, 1, *LOST, f"train.steps={LOST_STEPS}",
                        f"parallel.heartbeat_timeout_s={heartbeat_s}")
    _wait_for_step(tmp_path / "silent", 3, procs)
    t0 = time.monotonic()
    c.set_link(c.nodes[1], False)
    rc, out, err = finish(procs[0], 120)
    seconds = time.monotonic() - t0
    assert rc == 1, out[-2000:] + err[-4000:]
    line = _one_rank_line(err)
    assert line == (f"moe-dist train: rank 0: no heartbeat from node node1 (rank 1) for {heartbeat_s} s "
                    "(parallel.heartbeat_timeout_s): the job was stopped (resume=auto continues from the last "
                    "checkpoint)"), line
    assert heartbeat_s <= seconds < heartbeat_s + 30, seconds
    print(f"unplugged node, heartbeat {heartbeat_s} s: the survivor ended {seconds:.1f} s after the unplug")
    _checkpoints_complete(tmp_path / "silent")
    line1 = _rank_line_when_written(tmp_path / "silent.node1.err")
    assert re.fullmatch(rf"moe-dist train: rank 1: the job's rendezvous store at node0:\d+ has not answered for "
                        rf"{heartbeat_s} s \(parallel.heartbeat_timeout_s\): this node \(node1\) is cut off from the "
                        r"others, or node0 is lost; the job was stopped \(resume=auto continues from the last "
                        r"checkpoint\)", line1), line1
    print(f"the cut-off node's rank ended {time.monotonic() - t0:.1f} s after the unplug")


ELASTIC = ["parallel.ep=auto", "train.min_lr_ratio=1", "ckpt.every=5", "ckpt.verify=false",
           "parallel.heartbeat_timeout_s=10", "run.print_every=1"]
ELASTIC_STEPS = 24


def _line_at(path, text: str, since: float, timeout: float, after: str = "") -> float:
    """When ``text`` first shows in the file at ``path`` (after ``after``), in seconds after ``since``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = open(path).read()
        if after in content and text in content[content.index(after):]:
            return time.monotonic() - since
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path} within {timeout} s")


@pytest.mark.parametrize("how", ["killed", "unplugged"])
def test_elastic_torchrun_goes_on_without_a_lost_node(cluster, tmp_path, how):
    """NNODES=1:2: node1 lost at step 8 (its processes killed, or its link cut: then the heartbeat
    notices), node0's torchrun restarts its rank alone (1 rank now, ep=auto gives 1), which resumes
    from the step-5 checkpoint and finishes: no person involved; the steps after the restart equal a
    1-node run resumed from the same checkpoint, bit for bit, and those before the loss are within
    rounding of them; metrics.jsonl counts every step once."""
    import shutil

    c = cluster
    procs = start_nodes(c, tmp_path, "elastic", 2, 1, *ELASTIC, f"train.steps={ELASTIC_STEPS}", nnodes="1:2")
    run = tmp_path / "elastic"
    _wait_for_step(run, 8, procs)
    before_kill = metrics_rows(run)
    ref = tmp_path / "elastic-ref"  # the same checkpoint, for a run that is not interrupted
    os.makedirs(ref / "checkpoints")
    shutil.copytree(run / "checkpoints" / "step_000005", ref / "checkpoints" / "step_000005")
    shutil.copy(run / "config.yaml", ref / "config.yaml")
    t0 = time.monotonic()
    if how == "killed":
        c.kill_node(c.nodes[1])
    else:
        c.set_link(c.nodes[1], False)
    err0, out0 = tmp_path / "elastic.node0.err", tmp_path / "elastic.node0.out"
    noticed = _line_at(err0, "moe-dist train: rank 0:", t0, 120)
    reloaded = _line_at(out0, "resumed from", t0, 240, after="parallel: 2 process(es)")
    first = _line_at(out0, "step 6/", t0, 240, after="resumed from")
    rc, out, err = finish(procs[0], RUN_TIMEOUT)
    assert rc == 0, out[-2000:] + err[-4000:]
    restarted = out.count("parallel: 1 process(es)")
    print(f"elastic: node1 {how} at step {before_kill[-1]['step']}; node0's rank ended {noticed:.1f} s later, the "
          f"restarted rank had reloaded the step-5 checkpoint at {reloaded:.1f} s and made step 6 at {first:.1f} s")
    assert first < 60, first
    assert restarted == 1 and "parallel: 2 process(es)" in out, out[-3000:]
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == list(range(1, ELASTIC_STEPS + 1))  # every step once
    (rc_ref, out_ref, err_ref), = launch_nodes(c, tmp_path, "elastic-ref", 1, 1, *ELASTIC, "resume=auto",
                                              f"train.steps={ELASTIC_STEPS}")
    assert rc_ref == 0, out_ref[-2000:] + err_ref[-4000:]
    resumed = [r for r in metrics_rows(ref) if r["step"] > 5]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows[5:]] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in resumed]
    assert_curve_matches(before_kill[5:8], rows[5:8])



GROW_STEPS = 160


def test_elastic_torchrun_grows_again_when_the_lost_node_comes_back(cluster, tmp_path):
    """NNODES=1:2: node1 killed at step 8, node0 goes on alone; node1's launcher started again with the
    same rendezvous id (the node rebooted): node0's agent stops its rank at the membership change, both
    meet, and 2 ranks continue from the last complete checkpoint to the end. The steps after the growth
    equal a 2-node run resumed from the same checkpoint, bit for bit; metrics.jsonl has every step once."""
    import shutil

    c = cluster
    rdzv_id = f"grow-{time.time_ns()}"
    common = (*ELASTIC, f"train.steps={GROW_STEPS}")
    procs = start_nodes(c, tmp_path, "grow", 2, 1, *common, nnodes="1:2", rdzv_id=rdzv_id)
    run = tmp_path / "grow"
    _wait_for_step(run, 8, procs)
    c.kill_node(c.nodes[1])
    out0 = tmp_path / "grow.node0.out"
    _line_at(out0, "parallel: 1 process(es)", time.monotonic(), 240)
    alone = _line_at(out0, "step 12/", time.monotonic(), 240, after="parallel: 1 process(es)")
    t0 = time.monotonic()
    again = start_node(c, tmp_path, "grow", 1, 1, *common, master="node0", nnodes="1:2", rdzv_id=rdzv_id,
                       suffix=".again")
    grown = _line_at(out0, "parallel: 2 process(es)", t0, 240, after="parallel: 1 process(es)")
    resumed, first = None, None  # the checkpoint the grown job resumed from, and when it made the step after it
    deadline = time.monotonic() + 240
    while first is None and time.monotonic() < deadline:
        content = open(out0).read()
        grown_part = content[content.index("parallel: 1 process(es)"):]
        m = re.search(r"resumed from \S+step_(\d{6})", grown_part)
        if m and re.search(r"^step %d/" % (int(m.group(1)) + 1), grown_part[m.end():], flags=re.M):
            resumed, first = int(m.group(1)), time.monotonic() - t0
        time.sleep(0.05)
    rc, out, err = finish(procs[0], RUN_TIMEOUT)
    rc1, out1, err1 = finish(again, 60)
    assert rc == 0 and rc1 == 0, out[-2000:] + err[-4000:] + err1[-4000:]
    assert [m.group(1) for m in re.finditer(r"parallel: (\d) process\(es\)", out)] == ["2", "1", "2"], out[-3000:]
    assert resumed is not None and resumed >= 10, out[-3000:]
    print(f"elastic growth: node1's launcher started again when node0 alone was past step 12 ({alone:.1f} s after "
          f"its restart); node0's rank restarted for 2 nodes {grown:.1f} s after that, resumed from step {resumed} "
          f"and made step {resumed + 1} at {first:.1f} s")
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == list(range(1, GROW_STEPS + 1))  # every step once
    ref = tmp_path / "grow-ref"  # the same checkpoint, 2 nodes, not interrupted
    os.makedirs(ref / "checkpoints")
    name = f"step_{resumed:06d}"
    shutil.copytree(run / "checkpoints" / name, ref / "checkpoints" / name)
    shutil.copy(run / "config.yaml", ref / "config.yaml")
    refs = launch_nodes(c, tmp_path, "grow-ref", 2, 1, *ELASTIC, "resume=auto", f"train.steps={GROW_STEPS}")
    assert all(r[0] == 0 for r in refs), refs[0][1][-2000:] + refs[0][2][-4000:]
    replay = [r for r in metrics_rows(ref) if r["step"] > resumed]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows[resumed:]] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in replay]


def test_elastic_torchrun_stops_when_the_rendezvous_node_is_lost(cluster, tmp_path):
    """NNODES=1:2 with node0 (MASTER_ADDR: torchrun's rendezvous store) killed at step 8: node1's agent,
    which cannot meet anyone without that store, stops its rank and ends with one line saying so, in
    seconds (measured); no restart; the checkpoints stay complete for a resume by hand."""
    c = cluster
    procs = start_nodes(c, tmp_path, "host", 2, 1, *ELASTIC, f"train.steps={GROW_STEPS}", nnodes="1:2")
    run = tmp_path / "host"
    _wait_for_step(run, 8, procs)
    c.kill_node(c.nodes[0])
    t0 = time.monotonic()
    rc, out, err = finish(procs[1], 300)
    seconds = time.monotonic() - t0
    assert rc == 1 and seconds < 120, (rc, seconds, err[-4000:])
    # one line either way: the agent's when it notices first, else the rank's own (its collective failed
    # first, e.g. in a checkpoint's all_gather; the agent then stays silent: torchrun_launch.store_lost_line)
    line = _one_rank_line(err)
    assert line == ("moe-dist train: this node's torchrun lost the job's rendezvous store at node0:29500 "
                    "(the first node ended, or this node cannot reach it any more); the job stopped") or (
        line.startswith("moe-dist train: rank 1: the collective ")
        and "another rank went away; the job's rendezvous store at node0:" in line
        and line.endswith("this node (node1) is cut off from the others, or node0 is lost")), line
    assert "parallel: 1 process(es)" not in out, out[-3000:]  # no restart without the store
    print(f"elastic, the rendezvous node lost at step 8: node1's launcher ended {seconds:.1f} s later")
    _checkpoints_complete(run)
