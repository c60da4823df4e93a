"""The training loop.

One optimizer step = ``train.grad_accum`` micro-batches of ``global_batch / grad_accum``
sequences spread over the data-parallel ranks; the step itself, and why any number of ranks
computes what one process computes on the whole batch, is :mod:`moe_dist.train.loop.step`.

The :class:`Trainer` wires the parts together and runs the loop; it hands the run's health
(bad steps, divergence, rollback) to :class:`~moe_dist.train.loop.health.RunHealth`, what the run
reports (log, run.json, summary.json, plots) to :class:`~moe_dist.train.observe.reporting.RunReport`,
each step's metrics row to :class:`~moe_dist.train.observe.row.StepMetrics` and the checkpoints to
:class:`~moe_dist.train.checkpoint.TrainingCheckpoints`. The runtime and the data it starts from
are :mod:`moe_dist.train.setup.runtime` and :mod:`moe_dist.train.setup.data`.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

from ...config import Config, ConfigError, save_config
from ...config.load import config_to_dict
from ...data import TrainSampler
from ...diagnostics import RoutingDiagnostics
from ...distributed.bootstrap import Runtime, shutdown
from ...hardware import batch_to_device
from ...model import count_parameters
from ...moe import moe_layers
from ...safe_io import UnsafePath, own_directory, refuse_link
from ...tuning.attention import decide_attention_dtype
from ...tuning.expert_kernel import agree_expert_kernels
from ..checkpoint import TrainingCheckpoints
from ..engines import create_engine, engine_scope
from ..evaluation.validation import autocast, evaluate, unigram_baseline, validation_batches
from ..observe.metrics import MetricsLogger
from ..observe.mfu import Utilisation
from ..observe.moe_stats import MoEStepStats
from ..observe.reporting import RunReport, RunTotals
from ..observe.row import StepMetrics
from ..observe.step_time import StepClock
from ..observe.tracking import check_tracking, start_tracking
from ..setup.data import load_data, resolve_vocab
from ..setup.model import build_meta_model, check_weights_directory, weights_filler
from ..setup.run_lock import RunDirLock
from ..setup.runtime import setup_runtime
from .compile import CompileClock, apply_compile, cache_dir, describe_compile, eager_router_reason, use_cache_dir
from .health import Divergence, RollingBack, RunHealth, TrainingDiverged, state_is_finite
from .optim import lr_at
from .preemption import PreemptionHandler, stop_if_requested
from .step import TrainStep


# the directories a run writes into inside run.dir (checkpoints, plots, TensorBoard events, Chrome traces)
RUN_SUBDIRS = ("checkpoints", "plots", "tb", "traces")


class Trainer:
    """The training loop around a model it builds, an engine (``train.engine``: how the model is spread
    and updated) and the checkpoints (``ckpt.*``, ``resume``), both given their parts explicitly."""

    def __init__(self, cfg: Config, rt: Optional[Runtime] = None, rollbacks: Optional[list] = None):
        self.cfg = cfg
        self._owns_runtime = rt is None
        self.rt = setup_runtime(cfg, rt)
        self.is_main = self.rt.is_main
        self.run_dir = cfg.run.dir
        self.report = RunReport(cfg, self.rt, self.run_dir)
        # rollbacks: this job's rollbacks, carried by train() from one trainer to the next
        self.health = RunHealth(cfg, self.run_dir, self.is_main, self.log, rollbacks)
        self.lock = RunDirLock(self.run_dir)
        try:
            self._setup()
        except BaseException:
            self.lock.release()
            raise

    def _take_run_dir(self) -> None:
        """Rank 0 locks run.dir for the run's life (before anything in it is touched); all ranks
        refuse together if another live run holds it."""
        refusal = self._claim_run_dir() if self.is_main else None
        if self.rt.distributed:
            box = [refusal]
            dist.broadcast_object_list(box, src=0)
            refusal = box[0]
        if refusal:
            raise ConfigError(refusal)

    def _claim_run_dir(self) -> Optional[str]:
        """Rank 0: lock run.dir and make sure what the run writes into is its own (no link to elsewhere
        for checkpoints/, plots/, tb/, traces/); why not, or None."""
        refusal = self.lock.acquire()
        if refusal is not None:
            return refusal
        try:  # before anything is written there
            for name in RUN_SUBDIRS:
                refuse_link(os.path.join(self.run_dir, name), "a directory a run writes into")
            for name in ("checkpoints", "plots"):
                own_directory(self.run_dir, name)
        except UnsafePath as e:
            self.lock.release()
            return str(e)
        return None

    def _setup(self) -> None:
        cfg = self.cfg
        check_weights_directory(cfg, cfg.ckpt.init_from)  # before anything is written
        check_tracking(cfg)  # every rank: log.wandb needs the wandb package
        self._take_run_dir()
        self.data = load_data(cfg, self.rt, self.log)
        vocab = resolve_vocab(cfg, self.data)

        # on the meta device: the engine splits it, then each rank allocates and fills only its part
        # (from ckpt.init_from, e.g. an upcycled checkpoint, or from train.seed; see setup/model.py)
        self.model = build_meta_model(cfg, vocab)
        self.params = count_parameters(self.model)
        self.model.set_activation_checkpointing(cfg.train.activation_checkpointing)
        self.engine = create_engine(cfg, self.rt, log=self.log)  # train.engine: native | deepspeed
        # the engine splits the model, allocates this rank's part, fills it, then builds the optimizer
        self.engine.prepare(self.model, fill=weights_filler(cfg, cfg.ckpt.init_from))
        self.moe = moe_layers(self.model)
        self._agree_expert_kernels()
        self._decide_attention_dtype()
        self._compile()
        self.moe_stats = MoEStepStats(self.model)
        self.run_step = TrainStep(cfg.train, self.rt, self.engine, self.model, self.moe_stats)
        self.diagnostics = RoutingDiagnostics()  # load balance, probe-set fluctuation, Symphony graphs
        self.clock = StepClock(cfg.run.time_every)  # where the loop's time goes (run.time_every)
        utilisation = Utilisation(cfg.model, vocab, cfg.train.seq_len, self.rt.device, cfg.train.dtype,
                                  self.rt.world_size)

        groups = self.rt.groups
        sources = self.data.sources
        self.sampler = TrainSampler([s.train for s in sources], cfg.train.seq_len, cfg.train.global_batch,
                                    cfg.train.grad_accum, groups.dp_rank, groups.dp_size, cfg.train.seed,
                                    weights=[s.weight for s in sources], names=[s.path for s in sources])
        self.val_batches = validation_batches(self.data, cfg.train.seq_len, cfg.eval, groups.dp_rank, groups.dp_size)
        self.checkpoints = TrainingCheckpoints(  # ckpt.* keys
            self.run_dir, config_to_dict(cfg), runtime=self.rt, model=self.model, optimizer=self.engine.optimizer,
            sampler=self.sampler, diagnostics=self.diagnostics, tokenizer_sha256=self.data.tokenizer.sha256,
            lr_schedule=lambda step: lr_at(step, cfg.train), counters=self.health.counters, log=self.log)
        self.step = self.checkpoints.resume()  # resume=auto|<path>: model, optimizer, sampler, RNG; tidies the run dir
        if self.checkpoints.resumed_from:
            self.engine.state_loaded()  # DeepSpeed: the loaded state into its ZeRO partitions
        self.health.reset(self.checkpoints.loaded_counters)
        for layer in self.moe:  # NaN router logits make a skipped step, not an error
            layer.raise_on_nonfinite_logits = False
        # log.wandb: rank 0's W&B run, continued from run.dir unless resume=none starts a new timeline
        self.tracker = start_tracking(cfg, self.is_main, new_timeline=cfg.resume == "none")
        writer = MetricsLogger(self.run_dir if self.is_main else None, cfg.run.tensorboard, self.tracker,
                               first_step=self.step + 1)
        # the metrics row of every step: tokens/s, the time split, MFU, the MoE figures (observe/row.py)
        self.metrics = StepMetrics(self.clock, utilisation, self.moe_stats, self.diagnostics, writer,
                                   cfg.train.global_batch * cfg.train.seq_len, cfg.run.log_every)
        self.health.take_up_divergence(self.step, self.checkpoints, self.sampler, writer)
        self.sampler.prefetch()  # the first step's windows, read while the rest of the start-up runs
        self.preemption = PreemptionHandler(self.rt.device)  # SIGUSR1/SIGTERM/SIGHUP: checkpoint and exit 75
        if self.is_main:
            save_config(cfg, os.path.join(self.run_dir, "config.yaml"))
            self.report.write_run_info(self.engine.dense_layout(), self.params, self.data)
            self.lock.admit_readers()  # the directory is tidied: `moe-dist eval` may read it while we train
            if self.tracker is not None:
                self.log(self.tracker.describe(self.step))

    def _compile(self) -> None:
        """``train.compile``: the blocks' compiled parts (compiled at the first forward), inductor's
        cache in :func:`~moe_dist.train.loop.compile.cache_dir`."""
        self.compiled, self.compile_clock = [], None
        if not self.cfg.train.compile:
            return
        use_cache_dir(cache_dir(self.cfg))
        self.compiled = apply_compile(self.model)
        self.compile_clock = CompileClock()

    def _sequences_per_rank(self) -> int:
        """Sequences in one rank's micro-batch (at least 1: ``Config.check_world``)."""
        return self.cfg.train.global_batch // self.cfg.train.grad_accum // self.rt.groups.dp_size

    def _agree_expert_kernels(self) -> None:
        """``model.moe.expert_kernel: auto``: one kernel per expert shape, timed on every rank and
        decided from the slowest rank's times, so every rank runs the same kernel."""
        cfg = self.cfg
        rows = self._sequences_per_rank() * cfg.train.seq_len * cfg.model.moe.top_k
        dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
        for decision in agree_expert_kernels(self.model, rows, dtype, self.rt.device, seed=cfg.train.seed):
            self.log(decision.describe())

    def _decide_attention_dtype(self) -> None:
        """``train.attention_dtype`` (under bf16): the attention kernel's dtype, timed on every rank
        at one micro-batch's shape when ``auto`` (:mod:`~moe_dist.tuning.attention`)."""
        cfg = self.cfg
        decision = decide_attention_dtype(self.model, cfg.train.attention_dtype, cfg.train.dtype,
                                          self._sequences_per_rank(), cfg.train.seq_len, self.rt.device)
        if decision is not None:
            self.log(decision.describe())

    def log(self, msg: str) -> None:
        """A line of rank 0's log (through the progress bar while it shows)."""
        self.report.log(msg)

    # ---- one step -------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step (:class:`~moe_dist.train.loop.step.TrainStep`) on the sampler's next batches;
        every ``run.time_every`` steps the step is profiled and split (:mod:`~moe_dist.train.observe.step_time`)."""
        with self.clock.phase("data"):
            batches = self.sampler.next_step()
            for note in self.sampler.pop_notes():  # a source whose data repeat
                self.log(note)
            self.sampler.prefetch()  # the next step's windows read from disk while this one computes
        due = self.clock.due(self.step + 1)
        trace = None
        if due and self.clock.profiled_steps < self.cfg.run.time_traces:
            trace = os.path.join(self.run_dir, "traces", f"step{self.step + 1:06d}-rank{self.rt.rank}.json")
        with self.clock.phase("step", profile=due, trace=trace):
            row = self.run_step(self.step, batches, self.health.loss_spike)
        self.step += 1
        return row

    def probe_fluctuation(self) -> dict:
        """Routing fluctuation of a fixed probe set (each rank's first validation batch) since the
        previous evaluation, per MoE layer (collective)."""
        if not self.val_batches:
            return {}
        probe = batch_to_device(self.val_batches[0][:, :-1], self.rt.device)
        with autocast(self.rt.device, self.cfg.train.dtype):
            return self.diagnostics.evaluate_probe(self.model, probe, self.step, group=self.rt.groups.dp)

    def _probe_due(self, last: bool, validated: bool) -> bool:
        every = self.cfg.eval.probe_every
        return bool(every and self.step % every == 0) or last or (not every and validated)

    def validate(self) -> dict:
        return evaluate(self.model, self.val_batches, self.rt.device, self.cfg.train.dtype, self.rt.groups.dp)

    def save(self) -> str:
        with self.engine.state_for_save():
            # never a checkpoint that resume=auto would walk back into
            if not state_is_finite(self.model, self.engine.optimizer, self.rt):
                raise TrainingDiverged(f"step {self.step}: the model or optimizer state holds non-finite values; "
                                       "no checkpoint was saved (resume=auto continues from the last one)")
            return self.checkpoints.save(self.step)

    # ---- the loop -------------------------------------------------------------------------
    def fit(self) -> dict:
        """Train from the resumed step to ``train.steps``: validate, probe, log, save and stop as
        configured; returns the run's summary (summary.json)."""
        cfg, steps = self.cfg, self.cfg.train.steps
        totals = RunTotals(tokens=self.step * cfg.train.global_batch * cfg.train.seq_len)
        self.report.describe_start(self.params, len(self.moe), self.engine.dense_layout(), self.data)
        baseline = unigram_baseline(self.data, cfg.train.seq_len, cfg.eval)
        last_val, row = None, {"loss": None}
        if cfg.eval.probe_every and self.step == 0:
            self.probe_fluctuation()  # the reference the first probe compares with
        with self.report.progress():
            self.clock.start()
            while self.step < steps:
                row, divergence = self._timed_step(totals)
                last = self.step == steps
                with self.clock.phase("eval"):
                    val = self._validate_if_due(row, last)
                    last_val = val or last_val
                    fluct = self.probe_fluctuation() if self._probe_due(last, val is not None) else {}
                self.metrics.add_time(row, self.step)
                with self.clock.phase("logging"):
                    self.metrics.log(row, fluct, last, self.rt.groups.dp, self.rt.device)
                    if divergence:
                        raise self.health.diverged(divergence, self.checkpoints)
                    self.report.step_done(self.step, row, last)
                with self.clock.phase("checkpoint"):
                    if (cfg.ckpt.every and self.step % cfg.ckpt.every == 0) or (last and cfg.ckpt.save_final):
                        self.save()
                    if cfg.ckpt.memory_every and self.step % cfg.ckpt.memory_every == 0 and not last:
                        with self.engine.state_for_save():
                            self.checkpoints.snapshot(self.step)
                stop_if_requested(self.preemption, self.step, steps, run_dir=self.run_dir, is_main=self.is_main,
                                  save=self.save, log=self.log)
                self.clock.iteration_done()
        self.checkpoints.end_snapshots()  # a run that ended well: its snapshots leave host memory
        if last_val is None:  # resumed from the last step's checkpoint: nothing left to train
            last_val = self.validate()
        summary = self.report.summary(self.step, row["loss"], last_val, baseline, totals, self.params, self.health,
                                      self.compiled, self.compile_clock)
        trained = totals.steps * cfg.train.global_batch * cfg.train.seq_len  # this run's tokens
        summary["time"] = self.metrics.time_summary(trained)
        self.metrics.close()
        self.report.finish(summary, totals, last_val, baseline, self.diagnostics, self.model, self.tracker)
        return summary

    def _timed_step(self, totals: RunTotals) -> tuple[dict, Optional[Divergence]]:
        """One step and its metrics row (:meth:`StepMetrics.start`; marked ``bad`` if it was), and the
        divergence it completes, if any."""
        cfg = self.cfg
        c0 = time.process_time()
        figures = self.train_step()
        cpu = time.process_time() - c0
        if self.compile_clock is not None and not self.compile_clock.said:  # once, after the first step
            self.compile_clock.said = True
            self.log(describe_compile(self.compiled, self.compile_clock.report(), cache_dir(cfg),
                                      cfg.model.moe.router, eager_router_reason(self.model)))
        totals.add(figures, self.metrics.tokens_per_step)
        divergence = self.health.check_step(self.step, figures)
        counters = {"tokens": totals.tokens, "epoch": round(self.sampler.epoch, 4),
                    "elapsed_s": round(totals.elapsed(), 2), "skipped_steps": self.health.skipped_steps}
        compilations = self.compile_clock.report()["graphs"] if self.compile_clock is not None else None
        return self.metrics.start(self.step, figures, cpu, counters, self.rt.device, compilations), divergence

    def _validate_if_due(self, row: dict, last: bool) -> Optional[dict]:
        """Every ``eval.every`` steps and at the last: the validation figures, also into ``row``."""
        every, steps = self.cfg.eval.every, self.cfg.train.steps
        if not ((every and self.step % every == 0) or last):
            return None
        val = self.validate()
        self.metrics.add_validation(row, val)
        self.log(f"step {self.step}/{steps}: val loss {val['loss']:.4f}, perplexity {val['ppl']:.2f}")
        return val

    def close(self) -> None:
        try:
            self.checkpoints.wait()  # an async save in flight
            self.preemption.restore()
            try:
                self.metrics.close()
            except OSError as e:
                if sys.exc_info()[0] is None:
                    raise
                self.log(f"metrics: could not finish writing metrics.jsonl: {e}")  # the error in flight matters more
            if self.tracker is not None:
                self.tracker.finish(sys.exc_info()[1])  # the error in flight, if any, marks the W&B run
            if self._owns_runtime:
                shutdown(self.rt)
        finally:
            self.lock.release()
            self.engine.close()


def train(cfg: Config, rt: Optional[Runtime] = None) -> dict:
    """Train as configured; returns the summary (same on every rank). With
    ``train.on_divergence=rollback`` a run that diverges starts again from its last checkpoint
    before the divergence (``resume=auto``), at most ``train.max_rollbacks`` times."""
    owns = rt is None
    rt = setup_runtime(cfg, rt)
    rollbacks: list = []
    try:
        with engine_scope(cfg, rt):
            while True:
                trainer = Trainer(cfg, rt, rollbacks=rollbacks)
                try:
                    return trainer.fit()
                except RollingBack:
                    cfg = dataclasses.replace(cfg, resume="auto")
                finally:
                    trainer.close()
    finally:
        if owns:
            shutdown(rt)
