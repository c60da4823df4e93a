"""In-memory snapshots on the namespace cluster (docs/snapshots.md): 2 nodes x 2 processes under
elastic torchrun (NNODES=1:2), ``ckpt.every=20``, a snapshot every step; node1 killed (its processes,
and its host memory: its holder removed) once step 22's snapshot is on node0. node0's torchrun
restarts its ranks alone, which continue from the newest snapshot (step 22 or later, not the disk
checkpoint of step 20) with no person acting, on the uninterrupted run's loss curve (1 process, to
rounding until the routing first parts). The same kill with snapshots off (today's disk path) is
timed too: the time from the kill to the next step, and the steps done again, for both are printed.

Needs root and ``ip netns``; skipped with the reason elsewhere.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from helpers.multinode_harness import (ROOT, RUN_TIMEOUT, _clean_nodes, _config, _env, cluster,  # noqa: F401 (fixtures)
                                       finish, start_nodes)
from helpers.run_dir import assert_curve_matches, metrics_rows
from moe_dist.train.checkpoint.holder import ROOT_ENV

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

STEPS, KILL_AFTER = 40, 22
JOB = ["parallel.ep=auto", "train.min_lr_ratio=1", "ckpt.every=20", "ckpt.verify=false",
       "parallel.heartbeat_timeout_s=10", "run.print_every=1"]


def _holder_steps(shm: str, node: str) -> dict[int, set[int]]:
    """step -> the shard ranks that ``node``'s holder has complete (every run of the test's root)."""
    found: dict[int, set[int]] = {}
    base = os.path.join(shm, f"moe_dist-{os.getuid()}")
    for run in os.listdir(base) if os.path.isdir(base) else []:
        where = os.path.join(base, run, node)
        for name in os.listdir(where) if os.path.isdir(where) else []:
            m = re.fullmatch(r"step_(\d+)\.shard_(\d+)", name)
            if m and os.path.exists(os.path.join(where, name, "COMPLETE")):
                found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return found


def _wait(cond, procs, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        assert all(p.poll() is None for p, _, _ in procs), f"a node's launcher ended before {what}"
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def _steps_logged(run) -> int:
    path = os.path.join(run, "metrics.jsonl")
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def _lose_node1(c, tmp_path, name: str, shm: str, memory: bool):
    """Run the job, kill node1 after step 22 (and its snapshot), let node0 finish alone; returns
    (the step node0 continued from, seconds from the kill to the next step, node0's output)."""
    overrides = [*JOB, f"train.steps={STEPS}", f"ckpt.memory_every={1 if memory else 0}"]
    procs = start_nodes(c, tmp_path, name, 2, 2, *overrides, nnodes="1:2")
    run = tmp_path / name
    if memory:  # node0 holds every shard of step 22: its ranks' own and node1's ranks' buddy copies
        _wait(lambda: _holder_steps(shm, "node0").get(KILL_AFTER) == {0, 1, 2, 3}, procs, RUN_TIMEOUT, "step 22")
    else:
        _wait(lambda: _steps_logged(run) >= KILL_AFTER, procs, RUN_TIMEOUT, "step 22")
    reached = _steps_logged(run)
    t0 = time.monotonic()
    c.kill_node(c.nodes[1])
    base = os.path.join(shm, f"moe_dist-{os.getuid()}")
    for run_key in os.listdir(base) if os.path.isdir(base) else []:  # node1's host memory is gone with it
        shutil.rmtree(os.path.join(base, run_key, "node1"), ignore_errors=True)
    out0 = tmp_path / f"{name}.node0.out"

    def after_resume(step_of):
        def check():
            text = open(out0).read()
            m = re.search(r"resumed from (the in-memory snapshot of step (\d+)|\S+step_(\d{6}))", text)
            if not m:
                return None
            start = int(m.group(2) or m.group(3))
            done = re.search(rf"^step {step_of(start)}/", text[m.end():], re.M)
            return (start, time.monotonic() - t0) if done else None
        return check

    start, next_step = _wait(after_resume(lambda s: s + 1), procs[:1], RUN_TIMEOUT, "the step after the resume")
    _, regained = _wait(after_resume(lambda s: max(s, reached) + 1), procs[:1], RUN_TIMEOUT, "the step after the kill")
    rc, out, err = finish(procs[0], RUN_TIMEOUT)
    finish(procs[1], 5)
    assert rc == 0, out[-3000:] + err[-4000:]
    return {"start": start, "reached": reached, "next_step_s": next_step, "regained_s": regained, "out": out}


def test_a_lost_node_costs_a_step_not_a_checkpoint_interval(cluster, tmp_path, monkeypatch):
    c = cluster
    shm = str(tmp_path / "shm")
    monkeypatch.setenv(ROOT_ENV, shm)  # the nodes' host memory for this test (a tmpfs in the test's directory)
    mem = _lose_node1(c, tmp_path, "memory", shm, memory=True)
    start, out = mem["start"], mem["out"]
    assert start >= KILL_AFTER, out[-3000:]  # not the disk checkpoint of step 20
    assert f"resumed from the in-memory snapshot of step {start} " in out
    assert "newer than the disk checkpoint of step 20" in out
    rows = metrics_rows(tmp_path / "memory")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # every step once
    ref = subprocess.run([sys.executable, "-m", "moe_dist.cli", "train", "--config",
                          *_config(tmp_path, "uninterrupted", *JOB, "parallel.ep=1", f"train.steps={STEPS}")],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT * 2)
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-3000:]
    assert_curve_matches(rows, metrics_rows(tmp_path / "uninterrupted"))
    assert not os.path.exists(os.path.join(shm, f"moe_dist-{os.getuid()}")), "host memory not cleaned at the end"

    disk = _lose_node1(c, tmp_path, "disk", shm, memory=False)
    assert disk["start"] == 20, disk["out"][-3000:]
    for label, r in (("snapshots", mem), ("disk (today)", disk)):
        resumed = re.search(r"found and assembled in \S+ s, loaded in \S+ s", r["out"])
        print(f"{label}: node1 killed with step {r['reached']} done; node0 continued from step {r['start']} "
              f"({r['reached'] - r['start']} step(s) to do again), made its next step {r['next_step_s']:.1f} s "
              f"and step {max(r['start'], r['reached']) + 1} {r['regained_s']:.1f} s after the kill"
              + (f" (the snapshot {resumed.group(0)})" if resumed else ""))
