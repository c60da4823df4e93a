"""The metrics row of a training step, from the step's own figures to its line in metrics.jsonl.

:class:`StepMetrics` owns the row: the trainer hands it what the step returned (losses, gradient
norm, learning rate, exchange bytes, ``bad``) and asks for the rest in the loop's order: the
throughput and counters (:meth:`StepMetrics.start`), the validation figures, the time split of a
profiled step and the model FLOPs utilisation (:meth:`StepMetrics.add_time`), and at a step worth
logging the MoE figures, written to metrics.jsonl, TensorBoard and W&B (:meth:`StepMetrics.log`).
The run's time and MFU summary comes from the same clock and peak (:meth:`StepMetrics.time_summary`).
"""
from __future__ import annotations

from typing import Optional

from ...hardware import cuda_memory_gib
from .metrics import MetricsLogger
from .mfu import Utilisation
from .moe_stats import MoEStepStats
from .step_time import StepClock, time_summary


class StepMetrics:
    """The rows of a run's steps. ``clock`` times the loop's phases (its profiled steps give the
    time split), ``utilisation`` gives MFU, ``moe_stats`` and ``diagnostics`` the MoE figures of a
    logged step, ``writer`` writes the rows (rank 0; a no-op elsewhere). ``tokens_per_step``:
    tokens of one optimizer step of the whole job. ``log_every``: ``run.log_every``."""

    def __init__(self, clock: StepClock, utilisation: Utilisation, moe_stats: MoEStepStats, diagnostics,
                 writer: MetricsLogger, tokens_per_step: int, log_every: int):
        self.clock, self.utilisation, self.writer = clock, utilisation, writer
        self.moe_stats, self.diagnostics = moe_stats, diagnostics
        self.tokens_per_step, self.log_every = tokens_per_step, log_every

    def start(self, step: int, figures: dict, cpu_s: float, counters: dict, device,
              compilations: Optional[int] = None) -> dict:
        """The row of ``step`` from the step's ``figures``: tokens per second over the step's data and
        step phases, the process's CPU seconds, ``counters`` (tokens, epoch, elapsed_s,
        skipped_steps) and the device's memory."""
        seconds = self.clock.seconds("data", "step")
        row = {"step": step, **figures, "tokens_per_s": self.tokens_per_step / seconds, "cpu_s": round(cpu_s, 4),
               **counters, **cuda_memory_gib(device)}
        if compilations is not None:
            row["compilations"] = compilations
        return row

    @staticmethod
    def add_validation(row: dict, val: dict) -> None:
        """The validation loss and perplexity of an evaluated step."""
        row.update(val_loss=val["loss"], val_ppl=val["ppl"])

    def add_time(self, row: dict, step: int) -> None:
        """A profiled step's row gets its time split (``time``) and, from then on, every row its model
        FLOPs utilisation (``mfu``; the peak is found on every rank at the first profiled step, so
        the ranks time their matmuls together, as they compute in training)."""
        timing = self.clock.row()
        if "compute_s" in timing:
            row["time"] = timing
        if self.clock.due(step):  # on every rank alike: the CPU peak is taken together
            self.utilisation.peak()
        if self.utilisation.peak_known:
            mfu = self.utilisation.of(row["tokens_per_s"])
            if mfu is not None:
                row["mfu"] = round(mfu, 5)

    def due(self, row: dict, last: bool, probed: bool) -> bool:
        """Whether the row of ``row['step']`` is written: every ``run.log_every`` steps, and at every
        step worth a look (the first, the last, a validation, a probe, a bad step, a time split)."""
        step = row["step"]
        return bool(step % self.log_every == 0 or last or "val_loss" in row or probed or step == 1 or row.get("bad")
                    or "time" in row)

    def log(self, row: dict, fluct: dict, last: bool, group, device) -> None:
        """When :meth:`due`: the step's MoE figures (collective over ``group``, the data-parallel
        ranks) with the routing diagnostics and the probe's fluctuation ``fluct``, then the row."""
        if not self.due(row, last, bool(fluct)):
            return
        row["moe"] = self.moe_stats.summary(group, device)
        for layer, figs in self.diagnostics.update(row["step"], row["moe"]).items():
            row["moe"][layer].update({k: v for k, v in figs.items() if k != "load"}, **fluct.get(layer, {}))
        self.writer.log(row)

    def time_summary(self, trained_tokens: int) -> dict:
        """summary.json's ``time``: the phases' totals, the top ops and the run's MFU."""
        return time_summary(self.clock, self.utilisation, trained_tokens)

    def close(self) -> None:
        self.writer.close()
