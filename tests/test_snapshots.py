"""In-memory snapshots (ckpt.memory_every, moe_dist/train/checkpoint/snapshots.py, holder.py).

* the choice of the snapshot to continue from: the newest step of which the survivors hold every
  shard (own and buddy copies), newer than the disk checkpoint; a survivor lacking a shard means an
  older step, or the disk checkpoint;
* buddies are on another node; the holder: a torn entry is never complete, another job's or
  config's entry is refused, two generations are kept, the packed form round-trips;
* 4 gloo ranks on 2 (named) nodes with snapshots every step: node B's memory lost after step 3,
  2 ranks on node A continue from the step-3 snapshot (not the disk checkpoint of step 2),
  resharded to the new layout, on the uninterrupted run's curve; with snapshots off the metrics
  are the same as without the key.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
import time

import pytest

from helpers.dist_harness import run_ranks
from helpers.run_dir import assert_curve_matches, metrics_rows
from moe_dist.config import load_config
from moe_dist.train.checkpoint.files import MARKER
from moe_dist.train.checkpoint.holder import ROOT_ENV, Holder, Shard, pack, unpack
from moe_dist.train.checkpoint.snapshots import buddies, choose

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "test.yaml")


def shards(step, world, ranks):
    return [Shard(step, r, world, 10) for r in ranks]


# ---- the choice ---------------------------------------------------------------------------------------
def test_the_newest_step_of_which_the_survivors_hold_every_shard():
    # 4 ranks on 2 nodes, node B lost: node A holds its own shards 0, 1 and the buddy copies of 2, 3
    a = ("nodeA", shards(22, 4, [0, 1, 2, 3]) + shards(21, 4, [0, 1, 2, 3]))
    assert choose([a, a], newer_than=20) == (22, 4)
    # a survivor lacks shard 3 of step 22 (its copy had not arrived): the step before
    partial = ("nodeA", shards(22, 4, [0, 1, 2]) + shards(21, 4, [0, 1, 2, 3]))
    assert choose([partial, partial], newer_than=20) == (21, 4)
    # shards spread over two survivors make a set together
    x, y = ("nodeA", shards(22, 4, [0, 1])), ("nodeC", shards(22, 4, [2, 3]))
    assert choose([x, y], newer_than=20) == (22, 4)
    # no complete set newer than the disk checkpoint: None (the disk checkpoint)
    lacking = ("nodeA", shards(22, 4, [0, 1, 2]) + shards(21, 4, [1, 2, 3]))
    assert choose([lacking], newer_than=20) is None
    assert choose([a], newer_than=22) is None
    assert choose([], newer_than=0) is None
    # one step saved by two worlds (a stale entry of another generation): not taken as complete
    mixed = ("nodeA", shards(22, 2, [0, 1]) + shards(22, 4, [0, 1, 2, 3]) + shards(21, 4, [0, 1, 2, 3]))
    assert choose([mixed], newer_than=0) == (21, 4)


def test_every_buddy_is_on_another_node():
    assert buddies((0, 0, 1, 1)) == [2, 3, 0, 1]
    assert buddies((0, 1, 2)) == [1, 2, 0]
    assert buddies((0, 0, 0, 1)) == [3, 3, 3, 0]
    assert buddies((0, 0)) == [None, None]


# ---- the holder ---------------------------------------------------------------------------------------
@pytest.fixture
def holder(tmp_path, monkeypatch):
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    h = Holder("run", "nodeA")
    h.ensure()
    return h


def _write(h, step, rank, run_id="r", fingerprint="f", world=2):
    tmp = h.staging(step, rank)
    with open(os.path.join(tmp, "data.distcp"), "wb") as f:
        f.write(b"x" * (step + rank))
    return h.publish(tmp, step, rank, {"run_id": run_id, "fingerprint": fingerprint, "world": world})


def _accept(marker):
    return None if (marker["run_id"], marker["fingerprint"]) == ("r", "f") else "another job or config"


def test_a_torn_entry_is_never_complete_and_two_generations_stay(holder):
    for step in (1, 2, 3):
        for rank in (0, 1):
            _write(holder, step, rank)
        holder.prune(step)
    found, refused = holder.complete(_accept)
    assert sorted((s.step, s.rank) for s in found) == [(2, 0), (2, 1), (3, 0), (3, 1)] and not refused
    tmp = holder.staging(4, 0)  # a writer killed before its rename
    open(os.path.join(tmp, "data.distcp"), "wb").write(b"half")
    entry = _write(holder, 4, 1)
    with open(os.path.join(entry, "data.distcp"), "ab") as f:  # a file of another size than its marker says
        f.write(b"more")
    os.remove(os.path.join(_write(holder, 5, 0), MARKER))  # no marker
    found, _ = holder.complete(_accept)
    assert sorted((s.step, s.rank) for s in found) == [(2, 0), (2, 1), (3, 0), (3, 1)]


def test_entries_after_the_resumed_step_are_another_timeline(holder):
    for step in (5, 6, 30):
        _write(holder, step, 0)
    holder.remove_after(6)
    assert [(s.step, s.rank) for s in holder.complete(_accept)[0]] == [(5, 0), (6, 0)]


def test_another_jobs_or_configs_snapshot_is_refused(holder):
    _write(holder, 7, 0, run_id="someone else")
    _write(holder, 7, 1, fingerprint="another config")
    found, refused = holder.complete(_accept)
    assert found == [] and len(refused) == 2 and all("another job or config" in r for r in refused)


def test_the_packed_form_round_trips_and_a_torn_one_is_refused(holder, tmp_path, monkeypatch):
    entry = _write(holder, 9, 1)
    data = pack(entry)
    other = Holder("run", "nodeB")
    other.ensure()
    unpack(data, other, 9, 1)
    assert [(s.step, s.rank) for s in other.complete(_accept)[0]] == [(9, 1)]
    with pytest.raises(Exception):
        unpack(data[:-3], other, 9, 0)
    assert [(s.step, s.rank) for s in other.complete(_accept)[0]] == [(9, 1)]
    assert not [n for n in os.listdir(other.path) if n.startswith(".")]  # nothing half-written left


def _state():
    import torch

    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(5, 7, generator=g), "half": torch.randn(3, 4, generator=g).to(torch.bfloat16),
            "optim.w.step": torch.tensor(12.0), "mask": torch.rand(9, generator=g) > 0.5,
            "rng": torch.randint(0, 255, (33,), dtype=torch.uint8, generator=g),
            "t": torch.randn(4, 6, generator=g).t()}  # not contiguous


def test_the_raw_form_round_trips_through_two_reused_generations_to_a_dcp_directory(holder):
    """A shard kept raw (one preallocated, mapped file per generation, reused in turn) converts into a DCP
    directory that DCP's loader (through the safe reader) reads back bit for bit; a generation being
    rewritten is never complete."""
    import torch
    import torch.distributed.checkpoint as dcp

    from moe_dist.safe_dcp import SafeFileSystemReader
    from moe_dist.train.checkpoint.holder import Slots, merge
    from moe_dist.train.checkpoint.raw_shard import copy_in, index_json, layout

    state = _state()
    items, nbytes = layout(state)
    assert [i.fqn for i in items] == list(state) and all(i.at % 64 == 0 for i in items)
    slots = Slots(holder, 0, nbytes, first_step=1)
    marker = {"run_id": "r", "fingerprint": "f", "world": 1}
    for step in (1, 2, 3):
        for t in state.values():
            if t.dtype.is_floating_point:
                t.add_(1)
        region, tmp = slots.stage(step, index_json(items, nbytes))
        copy_in(region, items, state)
        open(os.path.join(tmp, "meta.json"), "w").write("{}")
        slots.publish(step, marker)
        holder.prune(step, lambda shard: shard == 0)
    found, _ = holder.complete(_accept)
    assert sorted(s.step for s in found) == [2, 3]  # two generations, the same two files reused
    region, _tmp = slots.stage(4, None)  # being rewritten: step 2's entry is no longer complete
    assert sorted(s.step for s in holder.complete(_accept)[0]) == [3]
    out = merge(holder, 3, 1, {"format": "x"})
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=SafeFileSystemReader(out), no_dist=True)
    for k, v in state.items():
        assert v.dtype == loaded[k].dtype and torch.equal(v, loaded[k]), k


def test_a_holder_that_is_a_link_is_refused(tmp_path, monkeypatch):
    from moe_dist.train.checkpoint.files import CheckpointError

    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, tmp_path / f"moe_dist-{os.getuid()}")
    with pytest.raises(CheckpointError, match="not a directory of this user"):
        Holder("run", "nodeA").ensure()


# ---- 4 ranks on 2 named nodes, node B lost -----------------------------------------------------------------
STEPS, KILLED_AFTER = 6, 3


def config(root, name, *extra):
    return load_config(CONFIG, [f"run.dir={root}/{name}", f"data.cache_dir={root}/cache",
                                f"data.corpus={ROOT}/tests/data/python-docs", "run.tensorboard=false",
                                "run.plots=false", "run.progress=false", "train.min_lr_ratio=1",
                                "ckpt.save_final=false", "ckpt.verify=false", *extra])


class Killed(Exception):
    """Node B's end, right after step 3's snapshot reached every holder."""


def _on_named_nodes(rank, world, root, shm):
    """Ranks 0, 1 on nodeA, 2, 3 on nodeB: the uninterrupted run, then the run that loses nodeB after step 3."""
    os.environ[ROOT_ENV] = shm
    socket.gethostname = lambda: f"node{'AB'[rank // 2]}"  # the host names the ranks' nodes are told by
    import torch.distributed as dist

    from moe_dist.train.checkpoint.resume import TrainingCheckpoints
    from moe_dist.train.loop.trainer import train

    train(config(root, "uninterrupted", "parallel.ep=4", f"train.steps={STEPS}"))
    take = TrainingCheckpoints.snapshot

    def snapshot_then_stop(self, step):
        take(self, step)
        if step == KILLED_AFTER:
            self.snapshots.wait()
            dist.barrier()  # every rank's snapshot and buddy copy is in its holder
            raise Killed

    TrainingCheckpoints.snapshot = snapshot_then_stop
    try:
        train(config(root, "lost", "parallel.ep=4", f"train.steps={STEPS}", "ckpt.every=2", "ckpt.memory_every=1"))
    except Killed:
        pass


def _survivors(rank, world, root, shm, nodes):
    os.environ[ROOT_ENV] = shm
    socket.gethostname = lambda: nodes[rank]
    from moe_dist.train.loop.trainer import train

    out = io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out):
        train(config(root, "lost", "parallel.ep=2", f"train.steps={STEPS}", "ckpt.every=2", "ckpt.memory_every=1",
                     "resume=auto"))
    return time.monotonic() - t0, out.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("survivors", [("nodeA", "nodeA"), ("nodeA", "nodeC")], ids=["one-node", "a-new-node"])
def test_a_lost_node_costs_a_step_not_a_checkpoint_interval(tmp_path, survivors):
    """One-node: both survivors on node A, which holds every shard (its own and node B's buddy copies).
    A-new-node: one survivor on node A and one on a node C that holds nothing: node A sends it the
    shards, and the continued run's snapshots go from A to C and back."""
    root, shm = str(tmp_path / "runs"), str(tmp_path / "shm")
    run_ranks(_on_named_nodes, 4, args=(root, shm), timeout=400)
    holders = os.path.join(shm, f"moe_dist-{os.getuid()}")
    (run_key,) = os.listdir(holders)
    assert sorted(os.listdir(os.path.join(holders, run_key))) == ["nodeA", "nodeB"]  # one holder per node
    on_a = sorted(os.listdir(os.path.join(holders, run_key, "nodeA")))
    # two generations (steps 2, 3), own shards and the buddies'
    assert on_a == [f"step_{s:06d}.shard_{r:05d}" for s in (2, 3) for r in range(4)], on_a
    shutil.rmtree(os.path.join(holders, run_key, "nodeB"))  # node B and its memory are gone
    lost = os.path.join(root, "lost")
    before, uninterrupted = metrics_rows(lost), metrics_rows(os.path.join(root, "uninterrupted"))
    assert [r["step"] for r in before] == list(range(1, KILLED_AFTER + 1))
    # taking snapshots changes nothing the run computes
    assert [(r["loss"], r["grad_norm"]) for r in before] == [(r["loss"], r["grad_norm"]) for r in uninterrupted[:3]]
    (seconds, out), _ = run_ranks(_survivors, 2, args=(root, shm, survivors), timeout=300)
    assert f"resumed from the in-memory snapshot of step {KILLED_AFTER} " in out, out[-3000:]
    assert "newer than the disk checkpoint of step 2" in out and "now 2 rank(s), ep=2" in out, out[-3000:]
    rows = metrics_rows(lost)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert_curve_matches(rows, uninterrupted)
    assert not os.path.exists(holders)  # host memory cleaned at the normal end (the survivors' node was the last)
    print(f"2 survivors resumed from the in-memory snapshot and ended in {seconds:.1f} s")


# ---- a rank that cannot keep its snapshot -------------------------------------------------------------------
def _one_holder_full(rank, world, root, shm, full):
    """Rank 0 on nodeA (room enough), rank 1 on nodeB whose host memory is a 64 KiB tmpfs (ENOSPC)."""
    os.environ[ROOT_ENV] = full if rank == 1 else shm
    socket.gethostname = lambda: f"node{'AB'[rank]}"
    from moe_dist.train import train  # (the package name: the trainer module may move)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(config(root, "full", "train.steps=4", "ckpt.memory_every=1"))
    return out.getvalue()


@pytest.mark.slow
def test_a_rank_that_cannot_keep_its_snapshot_switches_them_off_for_the_job(tmp_path):
    """node B's holder is a full file system: every rank switches snapshots off at the first one (one
    line, from rank 0, naming rank 1's ENOSPC), the job goes on and computes what it does without them."""
    import subprocess

    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(full)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs (a full holder)")
    try:
        root, shm = str(tmp_path / "runs"), str(tmp_path / "shm")
        outs = run_ranks(_one_holder_full, 2, args=(root, shm, str(full)), timeout=300)
        assert os.listdir(full) == []  # nothing left on the full one
    finally:
        subprocess.run(["umount", str(full)], check=True)
    said = [line for out in outs for line in out.splitlines() if "in-memory snapshots switched off" in line]
    assert len(said) == 1 and "rank 1 cannot keep" in said[0] and "No space left on device" in said[0], outs
    run_ranks(_plain_run, 2, args=(root,), timeout=300)
    assert ([(r["loss"], r["grad_norm"]) for r in metrics_rows(os.path.join(root, "full"))]
            == [(r["loss"], r["grad_norm"]) for r in metrics_rows(os.path.join(root, "plain"))])


def _plain_run(rank, world, root):
    from moe_dist.train import train  # (the package name: the trainer module may move)

    train(config(root, "plain", "train.steps=4"))
