"""A job continued on fewer nodes, and on more, on the namespace cluster (tests/helpers/multinode_harness.py;
marker ``multinode``: opt-in, and skipped with the reason where it cannot run).

One loss curve, three layouts, each a real ``launch/torchrun.sh`` job with the same global batch:

* ``two_nodes``: 2 nodes x 2 processes, ``parallel.ep=4`` (every MoE layer's experts span both
  nodes), STEPS steps uninterrupted, a checkpoint every 10 steps, a validation every 5: the reference;
* ``shrunk``: that job as node1's loss leaves it after step SHRINK_AT + 2 (its complete
  checkpoints up to SHRINK_AT, metrics rows past it: a save is visible only when complete, and the
  loss itself is tests/test_multinode.py's) continued with ``resume=auto`` on node0 alone, half the
  ranks. Its unchanged command is refused before any step (``parallel.ep=4`` does not divide 2
  processes: one line naming the allowed values); with ``parallel.ep=auto`` it runs at ep=2;
* ``grown``: the shrunk run (1 node x 2) as of its checkpoint at GROW_AT, continued with the
  same command on 2 nodes x 2 (auto: ep=2, each expert group on one node).

Each continuation's first 5 steps match the uninterrupted run's losses to 1e-4 and its validation
perplexity 50 steps after the resume to 1% (the uninterrupted run being ``two_nodes`` for the
shrink, and the shrunk run's own continuation on 1 node for the growth); how far the steps in
between drift is printed (docs/lost-node.md, "Continuing on fewer nodes").
"""
from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from helpers.multinode_harness import _clean_nodes, _one_rank_line, cluster, finish, start_nodes  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

SHRINK_AT, GROW_AT, LATER = 10, 20, 50
CKPT_EVERY = 10  # divides SHRINK_AT and GROW_AT: the checkpoints the continuations start from
STEPS = GROW_AT + LATER
FIRST_STEPS, LOSS_TOL, PPL_TOL = 5, 1e-4, 0.01
# resume=auto on every launch: the very same command starts the job and continues it
JOB = [f"train.steps={STEPS}", f"ckpt.every={CKPT_EVERY}", "eval.every=5", "ckpt.verify=false", "resume=auto"]
AUTO = "parallel.ep=auto"
JOB_TIMEOUT = 600  # a 4-rank job of 70 steps: 1.5 min on the 2-core machine at a load of 15


def launch(c, tmp, name: str, nodes: int, nproc: int, *overrides) -> list[tuple[int, str, str]]:
    """``launch/torchrun.sh`` on the first ``nodes`` nodes with run.dir=tmp/name; [(rc, out, err)]."""
    procs = start_nodes(c, tmp, name, nodes, nproc, *JOB, *overrides)
    deadline = time.monotonic() + JOB_TIMEOUT
    results = [finish(p, deadline - time.monotonic()) for p in procs]
    for i, (rc, out, err) in enumerate(results):
        assert rc == 0, f"{name}: node{i} exited {rc}:\n{out[-3000:]}\n{err[-3000:]}"
    return results


def rows(run_dir) -> dict[int, dict]:
    """metrics.jsonl by step, every step once (a resumed run's rows after its resumed step are its own)."""
    found = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert [r["step"] for r in found] == list(range(1, len(found) + 1)), [r["step"] for r in found]
    return {r["step"]: r for r in found}


def as_lost_after(src, dst, checkpoint_step: int, last_row: int) -> None:
    """``dst``: run directory ``src`` as it was when a node was lost after step ``last_row``: its
    complete checkpoints up to ``checkpoint_step``, its metrics rows up to ``last_row``."""
    shutil.copytree(src, dst)
    where = os.path.join(dst, "checkpoints")
    for name in os.listdir(where):
        if int(name.split("_")[1]) > checkpoint_step:
            shutil.rmtree(os.path.join(where, name))
    kept = [line for line in open(os.path.join(src, "metrics.jsonl")) if json.loads(line)["step"] <= last_row]
    with open(os.path.join(dst, "metrics.jsonl"), "w") as f:
        f.writelines(kept)
    os.remove(os.path.join(dst, "summary.json"))


def files(run_dir) -> dict[str, tuple[int, int]]:
    """Every file under ``run_dir``: (size, modification time in ns) by relative path."""
    out = {}
    for where, _, names in os.walk(run_dir):
        for name in names:
            st = os.stat(os.path.join(where, name))
            out[os.path.relpath(os.path.join(where, name), run_dir)] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("resize")


@pytest.fixture(scope="module")
def two_nodes(cluster, tmp):
    (rc, out, _), _ = launch(cluster, tmp, "two_nodes", 2, 2, "parallel.ep=4")
    assert "parallel: 4 process(es)" in out and "ep=4," in out, out[-3000:]
    return rows(tmp / "two_nodes")


@pytest.fixture(scope="module")
def shrunk(cluster, tmp, two_nodes):
    c, run_dir = cluster, tmp / "shrunk"
    as_lost_after(tmp / "two_nodes", run_dir, SHRINK_AT, SHRINK_AT + 2)
    before = files(run_dir)
    # the job's unchanged command (parallel.ep=4) on the remaining node: refused before any step
    t0 = time.monotonic()
    proc, = start_nodes(c, tmp, "shrunk-refused", 1, 2, *JOB, "parallel.ep=4", f"run.dir={run_dir}")
    refused = (*finish(proc, JOB_TIMEOUT), time.monotonic() - t0)
    after = files(run_dir)
    (rc, out, err), = launch(c, tmp, "shrunk", 1, 2, AUTO)
    return {"refused": refused, "untouched": before == after, "out": out, "rows": rows(run_dir)}


@pytest.fixture(scope="module")
def grown(cluster, tmp, shrunk):
    as_lost_after(tmp / "shrunk", tmp / "grown", GROW_AT, GROW_AT)
    results = launch(cluster, tmp, "grown", 2, 2, AUTO)
    return {"out": results[0][1], "rows": rows(tmp / "grown")}


def test_the_unchanged_command_on_the_remaining_node_is_refused_before_any_step(shrunk):
    rc, out, err, seconds = shrunk["refused"]
    assert rc == 2, out[-2000:] + err[-3000:]
    assert _one_rank_line(err) == ("moe-dist train: error: parallel.ep: 4 must divide the world size 2; allowed on 2 "
                                   "process(es) with model.moe.num_experts=4: 1, 2 or auto"), err[-3000:]
    assert "resumed from" not in out and shrunk["untouched"]  # before any step: not a file of run.dir touched
    print(f"refused on the remaining node {seconds:.1f} s after the launch")


def curve_check(label: str, resumed: dict, reference: dict, start: int) -> None:
    """The resumed run continues ``reference``'s curve from ``start``: every step after it is its own,
    the first 5 within LOSS_TOL, the validation perplexity LATER steps on within PPL_TOL; the drift
    in between is printed."""
    steps = list(range(start + 1, STEPS + 1))
    assert sorted(s for s in resumed if s > start) == steps
    # the global batch kept: 8 sequences x 64 tokens a step, whatever the number of ranks
    assert all(resumed[s]["tokens"] == reference[s]["tokens"] == 8 * 64 * s for s in steps)
    first = steps[:FIRST_STEPS]
    assert [resumed[s]["loss"] for s in first] == pytest.approx([reference[s]["loss"] for s in first],
                                                                abs=LOSS_TOL, rel=0)
    later = start + LATER
    ppl, ref_ppl = resumed[later]["val_ppl"], reference[later]["val_ppl"]
    assert ppl == pytest.approx(ref_ppl, rel=PPL_TOL)
    diffs = [abs(resumed[s]["loss"] - reference[s]["loss"]) for s in steps]
    evals = [s for s in steps if "val_ppl" in reference[s]]
    ppl_diffs = [abs(resumed[s]["val_ppl"] / reference[s]["val_ppl"] - 1) for s in evals]
    print(f"{label}: first {FIRST_STEPS} steps after step {start}: max |loss difference| "
          f"{max(diffs[:FIRST_STEPS]):.2e}; steps {start + 1}-{STEPS}: max {max(diffs):.2e} (step "
          f"{steps[diffs.index(max(diffs))]}), mean {sum(diffs) / len(diffs):.2e}; validation perplexity at step "
          f"{later}: {ppl:.4f} vs {ref_ppl:.4f} ({ppl / ref_ppl - 1:+.2e}); largest perplexity difference at the "
          f"{len(evals)} validations: {max(ppl_diffs):.2e}")


def test_the_job_continues_on_the_remaining_node_on_the_same_curve(shrunk, two_nodes):
    out = shrunk["out"]
    assert "parallel: 2 process(es)" in out and "ep=2 (parallel.ep=auto)" in out, out[-3000:]
    assert (f"at step {SHRINK_AT} (saved by 4 rank(s), ep=4, dense=fsdp; now 2 rank(s), ep=2)" in out), out[-3000:]
    rows_ = shrunk["rows"]
    assert all(rows_[s] == two_nodes[s] for s in range(1, SHRINK_AT + 1))  # the rows up to the checkpoint, kept
    curve_check("2 nodes x 2 (ep=4) -> 1 node x 2 (ep=auto: 2)", rows_, two_nodes, SHRINK_AT)


def test_a_one_node_run_grows_to_two_nodes_on_the_same_curve(grown, shrunk, two_nodes):
    out = grown["out"]
    assert "parallel: 4 process(es)" in out and "ep=2 (parallel.ep=auto)" in out, out[-3000:]
    assert f"at step {GROW_AT} (saved by 2 rank(s), ep=2, dense=fsdp; now 4 rank(s), ep=2)" in out, out[-3000:]
    curve_check("1 node x 2 (ep=2) -> 2 nodes x 2 (ep=auto: 2)", grown["rows"], shrunk["rows"], GROW_AT)
    # and all three layouts on the one curve of the job
    curve_check("2 nodes x 2 (ep=4) -> 1 node x 2 -> 2 nodes x 2, against 2 nodes x 2 throughout", grown["rows"],
                two_nodes, GROW_AT)
