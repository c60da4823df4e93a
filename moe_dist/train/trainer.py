"""The training loop.

One optimizer step = ``train.grad_accum`` micro-batches of ``global_batch / grad_accum``
sequences spread over the data-parallel ranks; the step itself, and why any number of ranks
computes what one process computes on the whole batch, is :mod:`moe_dist.train.step`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from collections import deque
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..config import Config, ConfigError, save_config
from ..config.load import config_to_dict
from ..data import PreparedData, TrainSampler, load_prepared, prepare_data
from ..diagnostics import RoutingDiagnostics, format_routing_summary, routing_summary
from ..distributed.bootstrap import Runtime, init_distributed, shutdown
from ..errors import CheckpointError, MissingInputError
from ..exits import JobStopped, end_process
from ..hardware import (batch_to_device, bf16_choice, cuda_memory_gib, map_large_allocations, peak_rss_bytes,
                        probe_shape)
from ..model import count_parameters
from ..parallel.kernel_choice import agree_expert_kernels
from ..moe import moe_layers
from ..moe.hierarchical import dispatch_note
from .checkpoint import TrainingCheckpoints, latest_checkpoint, load_checkpoint
from .checkpoint.collective import broadcast
from .checkpoint.divergence import last_good_step, read_record, record_divergence, take_pending
from .compile import CompileClock, apply_compile, cache_dir, describe_compile, eager_router_reason, use_cache_dir
from .engines import create_engine, engine_scope
from .evaluate import autocast, evaluate, format_report, unigram_baseline, validation_batches
from .metrics import MetricsLogger, MoEStepStats, read_metrics
from .model_setup import build_meta_model, check_weights_directory, is_weights_directory, weights_filler
from .optim import lr_at
from .parallelize import parallelize
from .preemption import PreemptionHandler, stop_if_requested
from .run_lock import RunDirLock
from .step import TrainStep
from .tracking import check_tracking, start_tracking


HEALTHY_BEFORE_CHECKS = 3  # healthy steps seen before a gradient-norm spike or a collapse can be judged


class TrainingDiverged(JobStopped):
    """Too many bad steps (see :meth:`Trainer.check_finite`), or non-finite state about to be saved."""


class RollingBack(Exception):
    """``train.on_divergence=rollback``: the run diverged, its checkpoints after the divergence are
    set aside; :func:`train` starts the trainer again with ``resume=auto``."""


@dataclasses.dataclass
class Divergence:
    """Bad steps from ``first_bad_step`` to ``stopped_at`` (non-finite, a loss or gradient-norm spike,
    a collapse), never a ``train.bad_step_window`` of steps without one between them; ``why``: the
    sentence that says what stopped the run."""

    first_bad_step: int
    stopped_at: int
    why: str


# set by `moe-dist ... --nproc N` when the user had no OMP_NUM_THREADS: the launcher's value is then
# the default (cores / local processes), not the user's choice
THREADS_DEFAULTED = "MOE_DIST_THREADS_DEFAULTED"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_choice(run_threads: Optional[int], local_world_size: int, env=os.environ) -> tuple[int, str]:
    """``(torch threads per process, why)``: ``run.threads`` if set, else the user's
    ``OMP_NUM_THREADS`` (a positive integer), else the cores this process may use / local processes."""
    if run_threads:
        return run_threads, "run.threads"
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) >= 1 and env.get(THREADS_DEFAULTED) != "1":
        return int(omp), "OMP_NUM_THREADS"
    cores, local = _cores(), max(1, local_world_size)
    return max(1, cores // local), f"{cores} core(s) / {local} local process(es)"


def _probe_shape(cfg, world_size: int) -> tuple[int, int, int]:
    """A matmul of the model's size for the bf16 probe: one rank's tokens of a micro-batch by the
    feed-forward weight."""
    rows = max(1, cfg.train.global_batch // cfg.train.grad_accum // world_size) * cfg.train.seq_len
    return probe_shape(rows, cfg.model.d_model, cfg.model.moe.d_ff or cfg.model.d_ff)


def _largest_over_ranks(rt: Runtime):
    """The largest of every rank's figure (the same on every rank after it): a choice each rank
    measures is made once for the job."""
    def agree(value: float) -> float:
        if not rt.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())
    return agree


def setup_runtime(cfg: Config, rt: Optional[Runtime] = None) -> Runtime:
    """The job's runtime (``rt``, or a new one), checked against the config's rules that need the
    number of processes. A new runtime that fails a check is shut down before the error leaves."""
    owns = rt is None
    if owns:
        rt = init_distributed(cfg.expert_parallel_size, cfg.model.moe.num_experts, backend=cfg.parallel.backend,
                              device=cfg.run.device, timeout_s=cfg.parallel.timeout_s,
                              ranks_per_node=cfg.parallel.ranks_per_node, dispatch=cfg.parallel.dispatch,
                              heartbeat_timeout_s=cfg.parallel.heartbeat_timeout_s,
                              on_lost_peer=lambda line: end_process(line, kind="lost_peer"))
    try:
        cfg.check_world(rt.world_size)
        torch.set_num_threads(thread_choice(cfg.run.threads, rt.launch.local_world_size)[0])
        cfg.train.dtype, note = bf16_choice(rt.device, cfg.train.dtype, cfg.train.bf16_on_slow_cpu,
                                            _probe_shape(cfg, rt.world_size), _largest_over_ranks(rt))
    except BaseException:
        if owns:
            shutdown(rt)  # while the error propagates: no meeting of the ranks, the group destroyed now
        raise
    if note and rt.is_main:
        print(note, flush=True)
    return rt


def load_data(cfg: Config, rt: Runtime, log: Callable[[str], None]) -> PreparedData:
    """The first process of each node builds the cache if needed (atomically); the rest wait."""
    directory = None
    if rt.launch.local_rank == 0:
        directory = prepare_data(cfg.data, log=log)
    if rt.distributed:
        dist.barrier()
    if directory is None:
        directory = prepare_data(cfg.data, log=lambda _: None)  # finds the finished cache
    return load_prepared(directory)


def resolve_vocab(cfg: Config, data: PreparedData) -> int:
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = data.vocab_size
    elif cfg.model.vocab_size < data.vocab_size:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's {data.vocab_size}; "
                          "allowed: null (use the tokenizer's) or at least the tokenizer's size")
    return cfg.model.vocab_size


MIN_STEPS_OF_DATA = 4  # a training set smaller than this many steps' tokens is worth a warning


def small_corpus_note(train_tokens: int, global_batch: int, seq_len: int, steps: int) -> str:
    """A warning when the training split holds fewer than a few steps' tokens ('' otherwise)."""
    per_step = global_batch * seq_len
    if train_tokens >= MIN_STEPS_OF_DATA * per_step:
        return ""
    return (f"warning: data: the training split has {train_tokens:,} tokens, {train_tokens / per_step:.2g} step(s) of "
            f"train.global_batch x train.seq_len = {per_step:,} tokens: every step sees the same text again "
            f"({steps * per_step / max(train_tokens, 1):.1f} epochs over train.steps={steps}); add text to data.corpus "
            "or lower train.global_batch / train.seq_len")


class Trainer:
    """The training loop around a model it builds, an engine (``train.engine``: how the model is spread
    and updated) and the checkpoints (``ckpt.*``, ``resume``), both given their parts explicitly."""

    def __init__(self, cfg: Config, rt: Optional[Runtime] = None, rollbacks: Optional[list] = None):
        self.cfg = cfg
        self.rollbacks = rollbacks if rollbacks is not None else []  # this job's rollbacks, carried by train()
        self._owns_runtime = rt is None
        self.rt = setup_runtime(cfg, rt)
        self.is_main = self.rt.is_main
        self.run_dir = cfg.run.dir
        self._bar = None
        self.lock = RunDirLock(self.run_dir)
        try:
            self._setup()
        except BaseException:
            self.lock.release()
            raise

    def _take_run_dir(self) -> None:
        """Rank 0 locks run.dir for the run's life (before anything in it is touched); all ranks
        refuse together if another live run holds it."""
        refusal = self.lock.acquire() if self.is_main else None
        if self.rt.distributed:
            box = [refusal]
            dist.broadcast_object_list(box, src=0)
            refusal = box[0]
        if refusal:
            raise ConfigError(refusal)

    def _setup(self) -> None:
        cfg = self.cfg
        check_weights_directory(cfg, cfg.ckpt.init_from)  # before anything is written
        check_tracking(cfg)  # every rank: log.wandb needs the wandb package
        self._take_run_dir()
        if self.is_main:
            os.makedirs(os.path.join(self.run_dir, "checkpoints"), exist_ok=True)
            os.makedirs(os.path.join(self.run_dir, "plots"), exist_ok=True)
        self.data = load_data(cfg, self.rt, self.log)
        vocab = resolve_vocab(cfg, self.data)

        # on the meta device: the engine splits it, then each rank allocates and fills only its part
        # (from ckpt.init_from, e.g. an upcycled checkpoint, or from train.seed; see model_setup)
        self.model = build_meta_model(cfg, vocab)
        self.params = count_parameters(self.model)
        self.model.set_activation_checkpointing(cfg.train.activation_checkpointing)
        self.engine = create_engine(cfg, self.rt, log=self.log)  # train.engine: native | deepspeed
        # the engine splits the model, allocates this rank's part, fills it, then builds the optimizer
        self.engine.prepare(self.model, fill=weights_filler(cfg, cfg.ckpt.init_from))
        self.moe = moe_layers(self.model)
        self._agree_expert_kernels()
        self._compile()
        self.moe_stats = MoEStepStats(self.model)
        self.run_step = TrainStep(cfg.train, self.rt, self.engine, self.model, self.moe_stats)
        self.diagnostics = RoutingDiagnostics()  # load balance, probe-set fluctuation, Symphony graphs

        groups = self.rt.groups
        self.sampler = TrainSampler(self.data.train.array(), cfg.train.seq_len, cfg.train.global_batch,
                                    cfg.train.grad_accum, groups.dp_rank, groups.dp_size, cfg.train.seed)
        self.val_batches = validation_batches(self.data, cfg.train.seq_len, cfg.eval, groups.dp_rank, groups.dp_size)
        self.checkpoints = TrainingCheckpoints(  # ckpt.* keys
            self.run_dir, config_to_dict(cfg), runtime=self.rt, model=self.model, optimizer=self.engine.optimizer,
            sampler=self.sampler, diagnostics=self.diagnostics, tokenizer_sha256=self.data.tokenizer.sha256,
            lr_schedule=lambda step: lr_at(step, cfg.train), counters=self.counters, log=self.log)
        self.step = self.checkpoints.resume()  # resume=auto|<path>: model, optimizer, sampler, RNG; tidies the run dir
        if self.checkpoints.resumed_from:
            self.engine.state_loaded()  # DeepSpeed: the loaded state into its ZeRO partitions
        self._reset_health(self.checkpoints.loaded_counters)
        for layer in self.moe:  # NaN router logits make a skipped step, not an error
            layer.raise_on_nonfinite_logits = False
        # log.wandb: rank 0's W&B run, continued from run.dir unless resume=none starts a new timeline
        self.tracker = start_tracking(cfg, self.is_main, new_timeline=cfg.resume == "none")
        self.metrics = MetricsLogger(self.run_dir if self.is_main else None, cfg.run.tensorboard, self.tracker,
                                     first_step=self.step + 1)
        self._take_up_divergence()
        self.preemption = PreemptionHandler(self.rt.device)  # SIGUSR1/SIGTERM/SIGHUP: checkpoint and exit 75
        if self.is_main:
            save_config(cfg, os.path.join(self.run_dir, "config.yaml"))
            self._write_run_info()
            self.lock.admit_readers()  # the directory is tidied: `moe-dist eval` may read it while we train
            if self.tracker is not None:
                self.log(self.tracker.describe(self.step))

    def _compile(self) -> None:
        """``train.compile``: the blocks' compiled parts (compiled at the first forward), inductor's
        cache in :func:`~moe_dist.train.compile.cache_dir`."""
        self.compiled, self.compile_clock = [], None
        if not self.cfg.train.compile:
            return
        use_cache_dir(cache_dir(self.cfg))
        self.compiled = apply_compile(self.model)
        self.compile_clock = CompileClock()

    def _agree_expert_kernels(self) -> None:
        """``model.moe.expert_kernel: auto``: one kernel per expert shape, timed on every rank and
        decided from the slowest rank's times, so every rank runs the same kernel."""
        cfg = self.cfg
        rows = cfg.train.global_batch // cfg.train.grad_accum // self.rt.groups.dp_size * cfg.train.seq_len * cfg.model.moe.top_k
        dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
        for decision in agree_expert_kernels(self.model, rows, dtype, self.rt.device, seed=cfg.train.seed):
            self.log(decision.describe())

    # ---- the run's health across steps, resumes and rollbacks -----------------------------
    def _reset_health(self, counters: dict) -> None:
        """The counters a checkpoint keeps (``counters``: its meta.json's, empty on a fresh start)."""
        self.skipped_steps = int(counters.get("skipped_steps", 0))
        self.rollback_count = max(int(counters.get("rollbacks", 0)), len(self.rollbacks))
        self.recent_losses = deque(counters.get("recent_losses", []), maxlen=self.cfg.train.spike_window)
        self.recent_grad_norms = deque(counters.get("recent_grad_norms", []), maxlen=self.cfg.train.spike_window)
        self.bad_steps: deque[int] = deque()  # the bad steps within the last train.bad_step_window
        self.first_bad_step = None

    def counters(self) -> dict:
        """What a checkpoint keeps of the run's health (JSON)."""
        return {"skipped_steps": self.skipped_steps, "rollbacks": self.rollback_count,
                "recent_losses": list(self.recent_losses), "recent_grad_norms": list(self.recent_grad_norms)}

    def _take_up_divergence(self) -> None:
        """After ``resume=auto`` from before a divergence (a stop or a rollback): continue its counters,
        skip the batches up to its first bad step if ``train.skip_divergent_batches``, log the rollback
        (metrics.jsonl, the summary). Any other start only moves the record to its history."""
        mine = read_record(self.run_dir)["pending"] if self.is_main else None
        pending = broadcast(mine, self.checkpoints.checkpointer.group)
        if pending is None:
            return
        skipped = 0
        if self.cfg.resume == "auto":
            self.skipped_steps = max(self.skipped_steps, int(pending["skipped_steps"]))
            self.rollback_count = max(self.rollback_count, int(pending["rollbacks"]) + int(pending["automatic"]))
            first = int(pending["first_bad_step"])
            if self.cfg.train.skip_divergent_batches and first > self.step:
                skipped = first - self.step
                self.sampler.skip_steps(skipped)
                self.log(f"resume: skipped the batches of steps {self.step + 1}..{first} (up to the first bad step "
                         "of the divergence; train.skip_divergent_batches=true)")
            event = {"first_bad_step": first, "stopped_at": pending["stopped_at"], "resumed_at": self.step,
                     "skipped_batches": skipped, "automatic": bool(pending["automatic"])}
            if pending["automatic"]:
                self.rollbacks.append(event)
            self.metrics.log({"step": self.step, "rollback": event})
        if self.is_main:
            take_pending(self.run_dir, self.step if self.cfg.resume == "auto" else None, skipped)

    def loss_spike(self, loss: float) -> bool:
        """``loss`` exceeds ``train.spike_factor`` x the median of the recent healthy losses (the same
        answer on every rank: the loss and the history are global figures)."""
        factor = self.cfg.train.spike_factor
        if factor is None or len(self.recent_losses) < self.recent_losses.maxlen:
            return False
        return loss > factor * statistics.median(self.recent_losses)

    # ---- reporting ------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        if not self.is_main:
            return
        if self._bar is not None:
            self._bar.write(msg)
        else:
            print(msg, flush=True)

    def _write_run_info(self) -> None:
        info = {
            "world_size": self.rt.world_size, "ep": self.rt.groups.ep_size, "dense": self.engine.dense_layout(),
            "launcher": self.rt.launch.launcher, "backend": self.rt.backend, "device": str(self.rt.device),
            "threads_per_process": torch.get_num_threads(), "parameters": self.params,
            "data": {"directory": self.data.directory, "source": self.data.manifest["source"],
                     "tokenizer_sha256": self.data.manifest["tokenizer"]["sha256"],
                     "token_count": self.data.manifest["token_count"]},
            "torch": torch.__version__, "python": platform.python_version(),
        }
        with open(os.path.join(self.run_dir, "run.json"), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2)

    def _progress(self):
        mode = self.cfg.run.progress
        show = self.is_main and (mode is True or (mode == "auto" and sys.stderr.isatty()))
        if not show:
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.train.steps, desc="train", unit="step", dynamic_ncols=True, leave=True)

    # ---- one step -------------------------------------------------------------------------
    def train_step(self) -> dict:
        """One optimizer step (:class:`~moe_dist.train.step.TrainStep`) on the sampler's next batches."""
        row = self.run_step(self.step, self.sampler.next_step(), self.loss_spike)
        self.step += 1
        return row

    def check_finite(self, row: dict) -> Optional[Divergence]:
        """Count a bad step: skipped (a non-finite loss, gradient norm or router logits, a loss spike) or
        applied but a sign of divergence (:meth:`applied_bad_step`). ``train.max_nonfinite_steps`` of them
        within ``train.bad_step_window`` steps make the divergence that stops (or rolls back) training,
        raised once the step's metrics row is written; it began at the first bad step not followed by a
        whole window without one. An engine that did not skip a non-finite step stops at once, before
        anything is saved."""
        cfg = self.cfg.train
        limit, window = cfg.max_nonfinite_steps, cfg.bad_step_window
        finite = math.isfinite(row["loss"]) and math.isfinite(row["aux_loss"]) and math.isfinite(row["grad_norm"])
        if not finite and not row.get("skipped"):
            return Divergence(self.first_bad_step or self.step, self.step,
                              f"step {self.step}: loss {row['loss']}, gradient norm {row['grad_norm']} are not finite "
                              f"and train.engine={cfg.engine} did not skip the update; stopped before saving")
        while self.bad_steps and self.bad_steps[0] <= self.step - window:
            self.bad_steps.popleft()
        why = self._bad_step_words(row) if row.get("skipped") else self.applied_bad_step(row)
        if why is None:
            if not self.bad_steps:
                self.first_bad_step = None
            self.recent_losses.append(row["loss"])
            self.recent_grad_norms.append(row["grad_norm"])
            return None
        row["bad"] = why
        self.bad_steps.append(self.step)
        if self.first_bad_step is None:
            self.first_bad_step = self.step
        if row.get("skipped"):
            self.skipped_steps += 1
        done = "the update was skipped" if row.get("skipped") else "the update (clipped) was applied"
        self.log(f"step {self.step}: {why}: {done} ({len(self.bad_steps)} bad step(s) within {window}, "
                 f"train.max_nonfinite_steps={limit})")
        if len(self.bad_steps) < limit:
            return None
        steps = ", ".join(map(str, self.bad_steps))
        return Divergence(self.first_bad_step, self.step,
                          f"training diverged: steps {steps} were bad ({limit} within {window} steps = "
                          f"train.max_nonfinite_steps within train.bad_step_window; a non-finite loss, gradient norm "
                          f"or router logits, a loss or gradient-norm spike, or a collapse)")

    def applied_bad_step(self, row: dict) -> Optional[str]:
        """Why an applied step is a sign of divergence, or None: its gradient norm beyond
        ``train.grad_spike_factor`` x the recent healthy median, or (``train.detect_collapse``) its loss
        back at ln(vocab) after training had brought it well below, or a gradient of exactly zero after
        non-zero ones. The same answer on every rank: global figures."""
        cfg = self.cfg.train
        if len(self.recent_grad_norms) < min(cfg.spike_window, HEALTHY_BEFORE_CHECKS):
            return None
        norm, median_norm = row["grad_norm"], statistics.median(self.recent_grad_norms)
        if cfg.grad_spike_factor is not None and norm > cfg.grad_spike_factor * median_norm:
            return (f"gradient norm {norm:.4g} spiked over train.grad_spike_factor={cfg.grad_spike_factor:g} x the "
                    f"median {median_norm:.4g} of the last {len(self.recent_grad_norms)} healthy steps")
        if not cfg.detect_collapse:
            return None
        uniform, median_loss = math.log(self.cfg.model.vocab_size), statistics.median(self.recent_losses)
        if median_loss < 0.9 * uniform and row["loss"] >= 0.98 * uniform:
            return (f"loss {row['loss']:.4f} is back at ln(vocab) = {uniform:.4f} (a uniform guess) after a median of "
                    f"{median_loss:.4f} over the last {len(self.recent_losses)} healthy steps: the model collapsed")
        if norm == 0.0 and median_norm > 0.0:
            return "gradient norm exactly 0 after non-zero ones: the model collapsed"
        return None

    def _bad_step_words(self, row: dict) -> str:
        if row.get("router_nonfinite"):
            bad = row["router_nonfinite"]
            where = ", ".join(f"layer {i}: {n}" for i, n in bad.items()) if isinstance(bad, dict) else "on another rank"
            return f"router logits not finite ({where} NaN/Inf values)"
        if row.get("spike"):
            return (f"loss {row['loss']:.4g} spiked over train.spike_factor={self.cfg.train.spike_factor} x the median "
                    f"{statistics.median(self.recent_losses):.4g} of the last {len(self.recent_losses)} healthy steps")
        return f"loss {row['loss']:.4g}, gradient norm {row['grad_norm']:.4g}: not finite"

    def diverged(self, divergence: Divergence) -> TrainingDiverged:
        """Collective. Set aside the checkpoints after the last healthy state and record the
        divergence (rank 0); raise :class:`RollingBack` when ``train.on_divergence=rollback`` may roll
        back once more, else return the error that stops the run, naming the checkpoint
        ``resume=auto`` will take."""
        cfg = self.cfg.train
        self.checkpoints.wait()  # an async save in flight is set aside with the others
        good = last_good_step(divergence.first_bad_step)
        may_roll = cfg.on_divergence == "rollback" and self.rollback_count < cfg.max_rollbacks
        event = None
        if self.is_main:
            event = record_divergence(self.run_dir, {
                "first_bad_step": divergence.first_bad_step, "last_good_step": good, "stopped_at": divergence.stopped_at,
                "reason": divergence.why, "skipped_steps": self.skipped_steps, "rollbacks": self.rollback_count},
                rollback=may_roll)
        event = broadcast(event, self.checkpoints.checkpointer.group)
        when = " at the next start (`moe-dist eval` is reading the run directory)" if event["set_aside_later"] else ""
        aside = f"; set aside{when}: {', '.join(event['set_aside'])}" if event["set_aside"] else ""
        if event["resume_from"] is None:
            where = f"resume=auto starts from step 0 (no checkpoint of step {good} or before{aside})"
        else:
            where = f"resume=auto continues from {event['resume_from']} (step {event['resume_step']}{aside})"
        began = (f"the divergence began at step {divergence.first_bad_step}, so the last trusted state is step "
                 f"{good}'s")
        if event["automatic"]:
            self.log(f"{divergence.why}; {began}; rolling back ({self.rollback_count + 1} of train.max_rollbacks="
                     f"{cfg.max_rollbacks}): {where}")
            raise RollingBack(divergence.why)
        window = ""
        if event["resume_step"] < divergence.first_bad_step and not cfg.skip_divergent_batches:
            window = (f"; train.skip_divergent_batches=true also skips the batches of steps {event['resume_step'] + 1}.."
                      f"{divergence.first_bad_step}")
        limit = (f" after {self.rollback_count} rollback(s) (train.max_rollbacks={cfg.max_rollbacks})"
                 if cfg.on_divergence == "rollback" and not may_roll else "")
        return TrainingDiverged(f"{divergence.why}{limit}; {began}. Lower train.lr (or raise train.warmup_steps); "
                                f"{where}{window}")

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

    def state_is_finite(self) -> bool:
        """Collective: every weight and optimizer state entry of every rank is finite (one read)."""
        tensors = [p for p in self.model.parameters()]
        tensors += [v for state in self.engine.optimizer.state.values() for v in state.values()
                    if torch.is_tensor(v) and v.is_floating_point()]
        flags = [torch.isfinite(t.to_local() if hasattr(t, "to_local") else t).all() for t in tensors]
        flags = [f.to(self.rt.device) for f in flags if f.device.type != "meta"]
        ok = torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=self.rt.device)
        ok = ok.to(torch.int32).view(1)
        if self.rt.distributed:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def save(self) -> str:
        with self.engine.state_for_save():
            if not self.state_is_finite():  # never a checkpoint that resume=auto would walk back into
                raise TrainingDiverged(f"step {self.step}: the model or optimizer state holds non-finite values; "
                                       "no checkpoint was saved (resume=auto continues from the last one)")
            return self.checkpoints.save(self.step)

    # ---- the loop -------------------------------------------------------------------------
    def fit(self) -> dict:
        cfg = self.cfg
        t_start = time.perf_counter()
        steps = cfg.train.steps
        self.log(f"model: {self.params['total'] / 1e6:.2f}M parameters ({self.params['active'] / 1e6:.2f}M active per "
                 f"token), {len(self.moe)} MoE layers x {cfg.model.moe.num_experts} experts, top-{cfg.model.moe.top_k}, "
                 f"router {cfg.model.moe.router}")
        over = f" over {self.rt.socket_interface}" if self.rt.socket_interface else ""  # this host's interface
        dispatch = dispatch_note(self.rt.groups)  # parallel.dispatch: hierarchical (or why it fell back)
        self.log(f"parallel: {self.rt.world_size} process(es) [{self.rt.launch.launcher}, {self.rt.backend or 'no backend'}{over}, "
                 f"{self.rt.device}, {torch.get_num_threads()} thread(s) each from "
                 f"{thread_choice(cfg.run.threads, self.rt.launch.local_world_size)[1]}], ep={self.rt.groups.ep_size}"
                 f"{' (parallel.ep=auto)' if cfg.parallel.ep == 'auto' else ''}, "
                 f"{dispatch + ', ' if dispatch else ''}"
                 f"dense={self.engine.dense_layout()}; data: "
                 f"{self.data.train.count:,} train tokens, {cfg.train.global_batch}x{cfg.train.seq_len} tokens per step")
        node_limit = cfg.model.moe.node_limit_warning(self.rt.groups.ep_nodes)
        if node_limit:
            self.log(node_limit)
        small = small_corpus_note(self.data.train.count, cfg.train.global_batch, cfg.train.seq_len, steps)
        if small:
            self.log(small)
        baseline = unigram_baseline(self.data, cfg.train.seq_len, cfg.eval)
        self._bar = self._progress()
        tokens_seen, last_val, row = self.step * cfg.train.global_batch * cfg.train.seq_len, None, {"loss": None}
        a2a_bytes, steps_run = [0, 0], 0  # this run's [intra, inter] bytes over its steps (summary.json)
        if cfg.eval.probe_every and self.step == 0:
            self.probe_fluctuation()  # the reference the first probe compares with
        try:
            while self.step < steps:
                t0, c0 = time.perf_counter(), time.process_time()
                row, fluct = self.train_step(), {}
                dt, cpu = time.perf_counter() - t0, time.process_time() - c0
                if self.compile_clock is not None and not self.compile_clock.said:
                    self.compile_clock.said = True
                    self.log(describe_compile(self.compiled, self.compile_clock.report(), cache_dir(cfg),
                                              cfg.model.moe.router, eager_router_reason(self.model)))
                step_tokens = cfg.train.global_batch * cfg.train.seq_len
                tokens_seen += step_tokens
                a2a_bytes[0] += row["a2a_intra_bytes"]
                a2a_bytes[1] += row["a2a_inter_bytes"]
                steps_run += 1
                diverged = self.check_finite(row)
                row = {"step": self.step, **row, "tokens_per_s": step_tokens / dt, "cpu_s": round(cpu, 4),
                       "tokens": tokens_seen,
                       "epoch": round(self.sampler.epoch, 4), "elapsed_s": round(time.perf_counter() - t_start, 2),
                       "skipped_steps": self.skipped_steps, **cuda_memory_gib(self.rt.device)}
                if self.compile_clock is not None:
                    row["compilations"] = self.compile_clock.report()["graphs"]
                last = self.step == steps
                if (cfg.eval.every and self.step % cfg.eval.every == 0) or last:
                    last_val = self.validate()
                    row.update(val_loss=last_val["loss"], val_ppl=last_val["ppl"])
                    self.log(f"step {self.step}/{steps}: val loss {last_val['loss']:.4f}, perplexity {last_val['ppl']:.2f}")
                if self._probe_due(last, "val_loss" in row):
                    fluct = self.probe_fluctuation()
                if (self.step % cfg.run.log_every == 0 or last or "val_loss" in row or fluct or self.step == 1
                        or row.get("bad")):
                    row["moe"] = self.moe_stats.summary(self.rt.groups.dp, self.rt.device)
                    for layer, figs in self.diagnostics.update(self.step, row["moe"]).items():
                        row["moe"][layer].update({k: v for k, v in figs.items() if k != "load"}, **fluct.get(layer, {}))
                    self.metrics.log(row)
                if diverged:
                    raise self.diverged(diverged)
                if self._bar is not None:
                    self._bar.update(1)
                    self._bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}", refresh=False)
                elif self.step % cfg.run.print_every == 0 or self.step == 1 or last:
                    self.log(f"step {self.step}/{steps}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  "
                             f"grad_norm {row['grad_norm']:.3f}  {row['tokens_per_s']:.0f} tok/s  "
                             f"{row['elapsed_s']:.0f}s")
                if (cfg.ckpt.every and self.step % cfg.ckpt.every == 0) or (last and cfg.ckpt.save_final):
                    self.save()
                stop_if_requested(self)
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        if last_val is None:  # resumed from the last step's checkpoint: nothing left to train
            last_val = self.validate()
        wall = time.perf_counter() - t_start
        summary = {"steps": self.step, "train_loss": row["loss"], "val_loss": last_val["loss"], "val_ppl": last_val["ppl"],
                   "unigram_loss": baseline["loss"], "unigram_ppl": baseline["ppl"], "val_tokens": last_val["tokens"],
                   "train_seconds": round(wall, 1), "tokens": tokens_seen, "parameters": self.params,
                   "skipped_steps": self.skipped_steps, "rollbacks": self.rollbacks,
                   # all-to-all bytes sent per step, summed over the ranks (None: no step trained in this run)
                   "a2a_intra_bytes_per_step": a2a_bytes[0] / steps_run if steps_run else None,
                   "a2a_inter_bytes_per_step": a2a_bytes[1] / steps_run if steps_run else None,
                   "peak_rss_gib": gather_peak_rss_gib(self.rt),  # every rank's, in order
                   **cuda_memory_gib(self.rt.device)}  # rank 0's
        if self.compile_clock is not None:  # this process's graphs and seconds spent compiling
            summary["compile"] = {"parts": len(self.compiled), **self.compile_clock.report()}
        self.metrics.close()
        if self.is_main:
            with open(os.path.join(self.run_dir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
            if cfg.run.plots:
                from .plots import make_plots

                make_plots(self.run_dir, baseline_loss=baseline["loss"])
                self.diagnostics.record_graphs(self.model)  # expert_load.png above covers the load heatmap
                self.diagnostics.write_pngs(os.path.join(self.run_dir, "plots"), include=("fluctuation", "graph"))
            self.log(f"done: {self.step} steps in {wall:.0f}s; run directory {self.run_dir}")
            self.log(format_report(last_val, baseline))
            routing = routing_summary(read_metrics(os.path.join(self.run_dir, "metrics.jsonl")))
            if self.tracker is not None:
                self.tracker.summary(summary, routing)
            self.log(format_routing_summary(routing))
        return summary

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


def gather_peak_rss(rt: Runtime) -> list[int]:
    """Every rank's peak resident memory (bytes), in rank order (collective)."""
    mine = peak_rss_bytes()
    if not rt.distributed:
        return [mine]
    out = [0] * rt.world_size
    dist.all_gather_object(out, mine)
    return out


def gather_peak_rss_gib(rt: Runtime) -> list[float]:
    """:func:`gather_peak_rss` in GiB (3 decimals), as summary.json and eval results report it."""
    return [round(b / 2**30, 3) for b in gather_peak_rss(rt)]


def evaluate_run(cfg: Config, checkpoint: Optional[str] = None, rt: Optional[Runtime] = None,
                 write_json: bool = True) -> dict:
    """Validation perplexity of a saved model next to the unigram baseline's (collective).

    ``checkpoint``: a training checkpoint directory (default: the latest complete one in
    ``run.dir``) or a safetensors model directory (``moe-dist upcycle`` / ``convert`` output),
    read rank-locally at any world size and ep. ``write_json``: write ``run.dir/eval.json``.
    """
    owns = rt is None
    rt = setup_runtime(cfg, rt)
    log = print if rt.is_main else (lambda _msg: None)
    if rt.device.type == "cpu":
        map_large_allocations()  # before the weights: freed gather buffers go back to the system
    try:
        path = checkpoint or latest_checkpoint(cfg.run.dir)
        if path is None:
            raise MissingInputError(f"no complete checkpoint under {os.path.join(cfg.run.dir, 'checkpoints')} (run.dir)")
        check_weights_directory(cfg, path)
        data = load_data(cfg, rt, log)
        vocab = resolve_vocab(cfg, data)
        model = build_meta_model(cfg, vocab)
        weights = is_weights_directory(path)
        parallelize(model, rt, cfg.parallel, fill=weights_filler(cfg, path if weights else None), dtype=cfg.train.dtype)
        meta = {"step": 0} if weights else load_checkpoint(model, path)
        if meta.get("tokenizer_sha256") not in (None, data.tokenizer.sha256):
            raise CheckpointError(f"{path} was trained with another tokenizer (sha256 {meta['tokenizer_sha256'][:12]}...) than "
                             f"the data settings give now ({data.tokenizer.sha256[:12]}...); check the data.* keys")
        batches = validation_batches(data, cfg.train.seq_len, cfg.eval, rt.groups.dp_rank, rt.groups.dp_size)
        val = evaluate(model, batches, rt.device, cfg.train.dtype, rt.groups.dp)
        baseline = unigram_baseline(data, cfg.train.seq_len, cfg.eval)
        result = {"checkpoint": path, "step": meta.get("step"), "val_loss": val["loss"], "val_ppl": val["ppl"],
                  "unigram_loss": baseline["loss"], "unigram_ppl": baseline["ppl"], "val_tokens": val["tokens"],
                  "world_size": rt.world_size, "ep": rt.groups.ep_size,
                  "peak_rss_gib": gather_peak_rss_gib(rt)}
        if rt.is_main:
            if write_json:
                os.makedirs(cfg.run.dir, exist_ok=True)
                with open(os.path.join(cfg.run.dir, "eval.json"), "w", encoding="utf-8") as f:
                    json.dump(result, f, indent=2)
            log(f"checkpoint {path} (step {meta.get('step')}), {rt.world_size} process(es), ep={rt.groups.ep_size}, "
                f"peak memory per process {max(result['peak_rss_gib']):.2f} GiB")
            log(format_report(val, baseline))
        return result
    finally:
        if owns:
            shutdown(rt)
