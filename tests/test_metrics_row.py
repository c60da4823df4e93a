"""The metrics row of a step (moe_dist/train/observe/row.py): one object computes tokens/s from the
step's timed phases, adds the validation figures, a profiled step's time split and MFU, the MoE
figures of a logged step, and writes the rows that are due to metrics.jsonl."""
import json
import os

import pytest
import torch

from moe_dist.config import load_config
from moe_dist.diagnostics import RoutingDiagnostics
from moe_dist.model import build_model
from moe_dist.train.observe.metrics import MetricsLogger
from moe_dist.train.observe.mfu import Utilisation
from moe_dist.train.observe.moe_stats import MoEStepStats
from moe_dist.train.observe.row import StepMetrics
from moe_dist.train.observe.step_time import StepClock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, TOKENS_PER_STEP = 512, 4 * 64
CPU = torch.device("cpu")


def _metrics(tmp_path, time_every=2, log_every=10):
    cfg = load_config(os.path.join(ROOT, "configs/test.yaml"), [f"model.vocab_size={VOCAB}"])
    model = build_model(cfg.model, VOCAB, seed=0)
    clock = StepClock(time_every)
    utilisation = Utilisation(cfg.model, VOCAB, cfg.train.seq_len, CPU, "fp32", world_size=1)
    metrics = StepMetrics(clock, utilisation, MoEStepStats(model), RoutingDiagnostics(),
                          MetricsLogger(str(tmp_path), tensorboard=False), TOKENS_PER_STEP, log_every)
    x = torch.randint(0, VOCAB, (4, cfg.train.seq_len))

    def step(number):
        """One step of the model, timed by the clock as the trainer does; its row and figures."""
        clock.start()
        with clock.phase("data"):
            batch = x.clone()
        with clock.phase("step", profile=clock.due(number)):
            loss = model(batch).float().logsumexp(-1).mean()
            loss.backward()
            metrics.moe_stats.add()
        counters = {"tokens": number * TOKENS_PER_STEP, "epoch": 0.0, "elapsed_s": 0.0, "skipped_steps": 0}
        return metrics.start(number, {"loss": float(loss.detach())}, 0.25, counters, CPU)

    return metrics, clock, step


def test_the_row_of_a_step_and_of_a_profiled_step(tmp_path):
    metrics, clock, step = _metrics(tmp_path)
    row = step(1)
    assert row["tokens_per_s"] == pytest.approx(TOKENS_PER_STEP / clock.seconds("data", "step"))
    assert (row["step"], row["loss"] > 0, row["cpu_s"], row["tokens"]) == (1, True, 0.25, TOKENS_PER_STEP)
    metrics.add_time(row, 1)  # step 1 is not profiled (run.time_every 2): no split, no peak yet
    assert "time" not in row and "mfu" not in row and not metrics.utilisation.peak_known
    clock.iteration_done()

    row = step(2)
    metrics.add_time(row, 2)  # profiled: the split, then MFU against the peak measured now
    assert row["time"]["compute_s"] > 0 and row["time"]["step_s"] > 0
    assert row["mfu"] == round(metrics.utilisation.of(row["tokens_per_s"]), 5) > 0
    summary = metrics.time_summary(2 * TOKENS_PER_STEP)
    assert summary["profiled_steps"] == 1 and summary["mfu"] > 0


def test_rows_due_are_written_with_their_moe_figures(tmp_path):
    metrics, clock, step = _metrics(tmp_path, time_every=0, log_every=3)
    for number in range(1, 7):
        row = step(number)
        if number == 4:
            metrics.add_validation(row, {"loss": 3.5, "ppl": 33.1})
        if number == 5:
            row["bad"] = True
        metrics.add_time(row, number)
        metrics.log(row, {}, last=number == 6, group=None, device=CPU)
        metrics.moe_stats.reset()
        clock.iteration_done()
    metrics.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    # the first, every third, a validation, a bad step and the last; step 2 is not due
    assert [r["step"] for r in rows] == [1, 3, 4, 5, 6]
    assert rows[2]["val_loss"] == 3.5 and rows[2]["val_ppl"] == 33.1 and rows[3]["bad"] is True
    for r in rows:
        layers = r["moe"]
        assert sorted(layers) == ["0", "1"] and "mfu" not in r
        assert sum(layers["0"]["expert_counts"]) == 4 * 64 * 2  # every token's k=2 choices, this step only
        assert layers["0"]["load_cv"] >= 0 and layers["0"]["max_load_ratio"] >= 1 and "load" not in layers["0"]
