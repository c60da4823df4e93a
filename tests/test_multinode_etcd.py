"""A rendezvous that outlives any one node: an etcd cluster of three members (launch/etcd.sh, Debian's
etcd-server) on the three nodes of a namespace cluster, and ``launch/torchrun.sh`` on each node with
``MOE_DIST_RDZV_ENDPOINTS`` (torchrun's etcd-v2 backend, PyPI's python-etcd) and ``NNODES=2:3``.

node0, the node that holds the rendezvous with the c10d backend (MASTER_ADDR, which the job cannot
outlive there: tests/test_multinode.py), is killed mid-run, its etcd member with it: node1's and node2's
agents meet again through their own members, restart their ranks on 2 nodes, which resume from the last
complete checkpoint and finish; no person acts. metrics.jsonl has every step once, and the steps after
the restart equal 2 nodes resumed from the same checkpoint, bit for bit.

Opt-in like every multi-node test (``MOE_DIST_MULTINODE=1``); needs root, ``ip netns``, etcd-server
(installed with apt-get when missing) and python-etcd (the ``etcd`` extra); skipped with the reason elsewhere.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from helpers.multinode_harness import (ROOT, RUN_TIMEOUT, _clean_nodes, _config, _env, finish,  # noqa: F401
                                       up_or_skip)
from helpers.run_dir import assert_curve_matches, metrics_rows

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

PORT = 23790  # the members' client port (peers: the next); inside the cluster's own namespaces only
STEPS = 24
# 3 ranks, then 2: a batch both divide; a checkpoint every 5 steps
COMMON = ["parallel.ep=auto", "train.global_batch=12", "eval.batch=6", "eval.max_sequences=12",
          "train.min_lr_ratio=1", "ckpt.every=5", "ckpt.verify=false", "parallel.heartbeat_timeout_s=10",
          "run.print_every=1", f"train.steps={STEPS}"]


def install_etcd() -> str:
    """'' when etcd is there (installing Debian's etcd-server with apt-get if needed), else why not."""
    if shutil.which("etcd"):
        return ""
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return "etcd is not installed, and apt-get (as root) is not there to install etcd-server"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "etcd-server"]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode:
            return f"`{' '.join(cmd)}` failed ({r.returncode}): {(r.stderr or r.stdout)[-400:]}"
    return "" if shutil.which("etcd") else "etcd still missing after apt-get install etcd-server"


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("etcd", reason="python-etcd (the etcd extra) is needed for torchrun's etcd-v2 rendezvous")
    reason = install_etcd()
    if reason:
        pytest.skip(f"cannot set up etcd: {reason}")
    yield from up_or_skip(nodes=3)


def _members_healthy(c, names: list[str], timeout: float) -> None:
    """Until every member answers /health with true (from inside node1), else AssertionError."""
    probe = ("import json, sys, urllib.request\n"
             "for h in sys.argv[1:]:\n"
             f"    assert json.load(urllib.request.urlopen(f'http://{{h}}:{PORT}/health', timeout=2))['health'] == 'true'\n")
    deadline = time.monotonic() + timeout
    while True:
        r = c.run(c.nodes[1], [sys.executable, "-c", probe, *names], env=_env())
        if r.returncode == 0:
            return
        assert time.monotonic() < deadline, f"etcd not healthy within {timeout} s: {r.stderr[-2000:]}"
        time.sleep(0.5)


def _torchrun(c, tmp, name: str, i: int, endpoints: str, *extra: str):
    env = _env(NPROC_PER_NODE="1", NNODES="2:3", RDZV_ID=f"{name}-{os.getpid()}", MOE_DIST_RDZV_ENDPOINTS=endpoints,
               RDZV_LAST_CALL_S="3")
    out = open(tmp / f"{name}.node{i}.out", "w+")
    err = open(tmp / f"{name}.node{i}.err", "w+")
    return (c.popen(c.nodes[i], ["bash", "launch/torchrun.sh", *_config(tmp, name, *COMMON, *extra)], env=env,
                    cwd=ROOT, stdout=out, stderr=err), out, err)


def test_the_job_goes_on_when_the_rendezvous_node_is_lost(cluster, tmp_path):
    """3 nodes x 1 rank, etcd members on all three; node0 killed after step 7: node1 and node2 finish from
    the step-5 checkpoint on 2 ranks, their steps those of 2 ranks on one host resumed from it."""
    c = cluster
    names = [nd.hostname for nd in c.nodes]
    endpoints = ",".join(f"{n}:{PORT}" for n in names)
    etcds = [c.popen(nd, ["bash", "launch/etcd.sh", ",".join(names), f"moe-test-{os.getpid()}"], cwd=ROOT,
                     env=_env(MOE_DIST_ETCD_PORT=str(PORT), MOE_DIST_ETCD_DIR=str(tmp_path / f"etcd-{nd.hostname}")),
                     stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"etcd-{nd.hostname}.err", "w"))
             for nd in c.nodes]
    try:
        _members_healthy(c, names, 60)
        procs = [_torchrun(c, tmp_path, "etcd", i, endpoints) for i in range(3)]
        run = tmp_path / "etcd"
        deadline = time.monotonic() + RUN_TIMEOUT
        while len(metrics_rows(run)) < 7:
            assert time.monotonic() < deadline and all(p[0].poll() is None for p in procs), \
                [finish(p, 1)[2][-3000:] for p in procs]
            time.sleep(0.2)
        c.kill_node(c.nodes[0])  # torchrun, its rank and the etcd member of node0
        t0 = time.monotonic()
        results = [finish(p, RUN_TIMEOUT) for p in procs[1:]]
        seconds = time.monotonic() - t0
    finally:
        for p in etcds:  # launch/etcd.sh stops its member and removes its data (node0's is gone already)
            p.terminate()
        for p in etcds:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    for rc, out, err in results:
        assert rc == 0, out[-2000:] + err[-4000:]
    out = results[0][1] + results[1][1]
    first = (tmp_path / "etcd.node0.out").read_text()  # rank 0 of the first round: node0's, gone with it
    assert "parallel: 3 process(es)" in first and "parallel: 3 process(es)" not in out, first[-3000:]
    assert out.count("parallel: 2 process(es)") == 1, out[-3000:]  # one restart, on node1 and node2
    m = re.search(r"resumed from \S+step_(\d{6})", out)
    assert m and int(m.group(1)) == 5, out[-3000:]
    rows = metrics_rows(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]  # every step once
    # the same checkpoint resumed by 2 ranks on one host, uninterrupted: what the 2 nodes computed (the
    # rendezvous may give either node rank 0: equal to rounding, until routing parts)
    ref = tmp_path / "etcd-ref"
    os.makedirs(ref / "checkpoints")
    shutil.copytree(run / "checkpoints" / "step_000005", ref / "checkpoints" / "step_000005")
    shutil.copy(run / "config.yaml", ref / "config.yaml")
    res = subprocess.run([sys.executable, "-m", "moe_dist.cli", "train", "--nproc", "2", "--config", "configs/test.yaml",
                          f"run.dir={ref}", f"data.cache_dir={tmp_path}/cache", "run.progress=false", "run.plots=false",
                          "run.tensorboard=false", "ckpt.save_final=false", *COMMON, "resume=auto"],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert_curve_matches(rows[5:], [r for r in metrics_rows(ref) if r["step"] > 5])
    print(f"\netcd rendezvous, node0 killed after step 7: node1 and node2 restarted on 2 nodes, resumed from step 5 "
          f"and finished {seconds:.1f} s after the kill")
