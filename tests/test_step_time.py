"""The step-time breakdown (moe_dist/train/observe/step_time.py): profiler ranges counted once by part,
and a real 2-rank step (expert-parallel 2, FSDP2) split into parts that add up to the step."""
import os

import pytest

from helpers.dist_harness import run_ranks
import json

from moe_dist.train.observe.step_time import SPLIT, StepClock, category, self_times, split_intervals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ranges_are_named_to_their_parts():
    assert category("moe_dist::a2a") == "a2a"
    assert category("FSDP::pre_forward (blocks.1)") == "weight_gather"
    assert category("FSDP::all_gather (blocks.1)") == "weight_gather"
    assert category("FSDP::post_backward_reduce (blocks.0)") == "grad_reduce"
    assert category("moe_dist::grad_reduce") == "grad_reduce"
    assert category("c10d::allreduce_") == "collectives"
    assert category("moe_dist::optimizer") == "optimizer"
    assert category("aten::mm") is None


def test_a_moment_counts_once_to_the_first_part():
    s = 1_000_000_000  # ns
    parts = split_intervals([
        (0, 2 * s, "optimizer"),        # 2 s of optimizer ...
        (s // 2, s, "collectives"),     # ... half a second of it waiting on a collective
        (s // 2, s, "collectives"),     # the same range nested: counted once
        (3 * s, 4 * s, "a2a"),
        (3 * s, 5 * s, "weight_gather"),  # overlaps the a2a for 1 s: that second is the a2a's
        (9 * s, 11 * s, "grad_reduce"),   # runs past the step's end: cut at it
    ], 0, 10 * s)
    assert parts == {"a2a": 1.0, "weight_gather": 1.0, "grad_reduce": 1.0, "collectives": 0.5,
                     "optimizer": 1.5, "compute": 5.0}
    assert list(parts)[:len(SPLIT)] == list(SPLIT)


def test_self_time_is_a_range_less_its_children():
    ms = 1_000_000  # ns
    ops = self_times([
        (0, 10 * ms, "step"),
        (1 * ms, 4 * ms, "aten::linear"),   # 3 ms, 2 of them in its mm
        (1 * ms, 3 * ms, "aten::mm"),
        (5 * ms, 6 * ms, "aten::mm"),       # a second mm, directly under the step
        (6 * ms, 6 * ms, "aten::view"),     # an instant op at the mm's end: a sibling, not a child
        (7 * ms, 9 * ms, "aten::add"),
    ])
    assert ops == pytest.approx({"step": 4e-3, "aten::linear": 1e-3, "aten::mm": 3e-3, "aten::view": 0.0,
                                 "aten::add": 2e-3})


def test_the_clock_sums_phases_and_scales_the_split():
    clock = StepClock(every=2)
    assert [clock.due(s) for s in (1, 2, 3, 4)] == [False, True, False, True]
    with clock.phase("data"):
        pass
    with clock.phase("step", profile=True):
        sum(range(2_000_000))  # ~50 ms: a scheduling hiccup outside the profiled range stays far below half of it
    row = clock.row()
    assert set(row) == {"data_s", "step_s", "eval_s"} | {f"{p}_s" for p in SPLIT + ("compute",)}
    assert row["compute_s"] == pytest.approx(row["step_s"], rel=0.5)  # nothing but compute in this step
    clock.iteration_done()
    totals = clock.totals()
    assert totals["profiled_steps"] == 1 and set(totals["seconds"]) == {"data", "step", "eval", "logging",
                                                                         "checkpoint", "other"}
    assert sum(totals["step_split_s"].values()) == pytest.approx(totals["seconds"]["step"], rel=1e-3, abs=1e-3)
    assert StepClock(every=0).due(5) is False
    assert StepClock(every=0).totals()["top_ops_ms"] is None


def test_a_profiled_step_lists_its_ops_and_writes_its_trace(tmp_path):
    import torch

    clock = StepClock(every=1)
    a = torch.randn(256, 256)
    trace = str(tmp_path / "traces" / "step1.json")
    with clock.phase("step", profile=True, trace=trace):
        for _ in range(20):
            a @ a
    ops = clock.totals()["top_ops_ms"]
    assert next(iter(ops)) == "aten::mm", ops  # the most self time first
    assert sum(ops.values()) <= 1e3 * clock.seconds("step") * 1.01
    with open(trace) as f:
        assert any(e.get("name") == "aten::mm" for e in json.load(f)["traceEvents"])


def _split(rank, world, tmp):
    from moe_dist.config import load_config
    from moe_dist.train.loop.trainer import Trainer

    cfg = load_config(os.path.join(ROOT, "configs/test.yaml"), [
        f"run.dir={tmp}/r", f"data.cache_dir={tmp}/cache", f"data.corpus={ROOT}/tests/data/python-docs",
        "run.tensorboard=false", "run.plots=false", "ckpt.save_final=false", "train.steps=3", "parallel.ep=2",
        "parallel.dense=fsdp"])
    trainer = Trainer(cfg)
    try:
        clock = StepClock(every=1)
        trainer.train_step()  # warm-up
        with clock.phase("step", profile=True):
            trainer.train_step()
        return clock.row()
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_two_rank_step_splits_into_parts_that_add_up(tmp_path):
    for row in run_ranks(_split, 2, (str(tmp_path),)):
        parts = {p: row[f"{p}_s"] for p in SPLIT + ("compute",)}
        assert sum(parts.values()) == pytest.approx(row["step_s"], rel=0.05), row
        # every kind of wait this layout has was seen: expert all-to-alls, FSDP2 gathers and
        # reductions, the losses' and norms' all-reduces, the update
        assert all(parts[p] > 0 for p in SPLIT), row
        assert parts["compute"] > 0, row
