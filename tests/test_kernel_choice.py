"""`expert_kernel: auto` decided once per job, identically on every rank.

The decision rule (fastest kernel, but `loop` unless another is faster by more than the margin),
the agreement over ranks (times reduced with MAX, so ranks whose own timings would pick
different kernels pick the same one), the fallbacks (too few rows, kernels that cannot run the
sizes) and the trainer's use of it, with real gloo processes.
"""
from __future__ import annotations

import contextlib
import io
import os

import torch

from helpers.dist_harness import run_ranks
from moe_dist.moe import MoEArgs, MoELayer
from moe_dist.moe.experts import GroupedExperts
from moe_dist.tuning.expert_kernel import KernelTuner
from moe_dist.tuning.expert_kernel import MIN_ROWS, agree_expert_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ScriptedTuner(KernelTuner):
    """Times given per rank instead of measured: what makes ranks disagree on their own."""

    def __init__(self, times: dict):
        super().__init__()
        self.times, self.calls = times, []

    def time_kernels(self, experts, x, counts):
        self.calls.append((experts.num_experts, experts.d_model, experts.d_ff, x.shape[0], x.dtype, list(counts)))
        return {k: v for k, v in self.times.items() if k in self.candidates(experts, x.dtype)}


def _model(d_model=32, d_ff=64, layers=2, kernel="auto"):
    torch.manual_seed(0)
    return torch.nn.ModuleList([MoELayer(d_model, MoEArgs(d_ff=d_ff, num_experts=4, top_k=2,
                                                          expert_kernel=kernel)) for _ in range(layers)])


def test_pick_rule():
    t = KernelTuner(margin=0.1)
    assert t.pick({"loop": 1.0, "bmm": 0.5, "grouped_mm": 0.7}) == "bmm"
    assert t.pick({"loop": 1.0, "bmm": 0.95, "grouped_mm": 0.92}) == "loop"  # within the margin: noise
    assert t.pick({"loop": 1.0, "bmm": 1.5}) == "loop"


def test_time_kernels_measures_each_candidate():
    """The real timing: every candidate runs forward and backward and gets a positive time."""
    experts = GroupedExperts(4, 32, 64, kernel="loop")
    times = KernelTuner(reps=1).time_kernels(experts, torch.randn(300, 32), [75] * 4)
    assert set(times) == {"loop", "bmm", "grouped_mm"} and all(0 < v < 60 for v in times.values()), times


def test_one_process_decides_and_fixes_every_auto_layer():
    model = _model()
    model.append(MoELayer(32, MoEArgs(d_ff=64, num_experts=4, top_k=2,
                                      expert_kernel="bmm")))  # a fixed kernel is left alone
    tuner = ScriptedTuner({"loop": 1.0, "bmm": 0.5, "grouped_mm": 0.7})
    decisions = agree_expert_kernels(model, 512, torch.float32, torch.device("cpu"), tuner=tuner)
    assert [m.experts.kernel for m in model] == ["bmm", "bmm", "bmm"]
    assert len(decisions) == 1 and decisions[0].layers == 2 and decisions[0].kernel == "bmm"
    assert tuner.calls == [(4, 32, 64, 512, torch.float32, [128] * 4)]  # one timing per distinct shape
    assert "auto -> bmm" in decisions[0].describe() and "bmm 500.0 ms" in decisions[0].describe()


def test_fallbacks():
    tuner = ScriptedTuner({"loop": 1.0, "bmm": 0.5, "grouped_mm": 0.2})
    model = _model()
    decisions = agree_expert_kernels(model, MIN_ROWS - 1, torch.float32, torch.device("cpu"), tuner=tuner)
    assert tuner.calls == [] and decisions[0].kernel == "loop" and decisions[0].times == {}
    assert "too few to time" in decisions[0].describe()
    # d_ff = 66 fp32 rows are not 16-byte aligned: grouped_mm is no candidate
    odd = _model(d_model=32, d_ff=66)
    decisions = agree_expert_kernels(odd, 512, torch.float32, torch.device("cpu"), tuner=tuner)
    assert set(decisions[0].times) == {"loop", "bmm"} and decisions[0].kernel == "bmm"


SCRIPTS = [  # rank -> its own timings: alone, rank 0 would pick bmm and rank 1 grouped_mm
    {"loop": 1.0, "bmm": 0.5, "grouped_mm": 0.95},
    {"loop": 1.0, "bmm": 2.0, "grouped_mm": 0.8},
]


def _agree(rank, world, scripted):
    model = _model()
    tuner = ScriptedTuner(SCRIPTS[rank]) if scripted else None
    alone = tuner.pick(SCRIPTS[rank]) if scripted else None
    decisions = agree_expert_kernels(model, 512, torch.float32, torch.device("cpu"), tuner=tuner)
    return {"alone": alone, "kernels": [m.experts.kernel for m in model],
            "times": [d.times for d in decisions]}


def test_ranks_that_disagree_alone_agree_together():
    r0, r1 = run_ranks(_agree, 2, args=(True,))
    assert (r0["alone"], r1["alone"]) == ("bmm", "grouped_mm")  # the control: alone they differ
    assert r0["kernels"] == r1["kernels"] == ["loop", "loop"]  # max: loop 1.0, bmm 2.0, grouped_mm 0.95
    assert r0["times"] == r1["times"] == [{"loop": 1.0, "bmm": 2.0, "grouped_mm": 0.95}]


def test_real_timings_agree_over_four_ranks():
    results = run_ranks(_agree, 4, args=(False,))
    assert all(r["kernels"] == results[0]["kernels"] and r["times"] == results[0]["times"] for r in results)
    assert results[0]["kernels"][0] in ("loop", "bmm", "grouped_mm")


def _trainer_kernels(rank, world, tmp):
    from moe_dist.config import load_config
    from moe_dist.distributed.bootstrap import init_distributed
    from moe_dist.train.loop.trainer import Trainer

    cfg = load_config(os.path.join(ROOT, "configs/test.yaml"), [
        f"run.dir={tmp}/run", f"data.cache_dir={tmp}/cache", f"data.corpus={ROOT}/tests/data/python-docs",
        "parallel.ep=2", "model.moe.expert_kernel=auto", "train.global_batch=8", "train.seq_len=64",
        "run.tensorboard=false", "run.progress=false", "run.plots=false"])
    rt = init_distributed(cfg.parallel.ep, cfg.model.moe.num_experts, backend="gloo", device="cpu")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # rank 0 logs the decision while the trainer is built
        trainer = Trainer(cfg, rt)
    return {"kernels": [layer.experts.kernel for layer in trainer.moe], "lines": out.getvalue().splitlines()}


def test_trainer_fixes_one_kernel_on_every_rank(tmp_path):
    r0, r1 = run_ranks(_trainer_kernels, 2, args=(str(tmp_path),))
    assert r0["kernels"] == r1["kernels"] and "auto" not in r0["kernels"]
    assert any("expert kernel auto ->" in line and "rows per rank" in line for line in r0["lines"]), r0["lines"]
