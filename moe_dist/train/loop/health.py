"""The run's health across steps, resumes and rollbacks: which steps are bad, when bad steps add
up to a divergence, and what a divergence does (stop, or roll back to the last trusted checkpoint).

:class:`RunHealth` holds the counters a checkpoint keeps (skipped steps, rollbacks, the recent
healthy losses and gradient norms) and the window of recent bad steps; the trainer owns one and
asks it after every step. The divergence record itself (set-aside checkpoints, pending rollback)
is :mod:`moe_dist.train.checkpoint.divergence`.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...config import Config
from ...distributed.bootstrap import Runtime
from ...exits import JobStopped
from ..checkpoint.collective import broadcast
from ..checkpoint.divergence import last_good_step, read_record, record_divergence, take_pending

HEALTHY_BEFORE_CHECKS = 3  # healthy steps seen before a gradient-norm spike or a collapse can be judged
# a loss at ln(vocab) that fell by more than this share since the step before is on its way down (a model
# recovering from one bad update), not a collapse: a collapsed model's loss stays at ln(vocab)
RECOVERING_DROP = 0.01


class TrainingDiverged(JobStopped):
    """Too many bad steps (see :meth:`RunHealth.check_step`), or non-finite state about to be saved."""


class RollingBack(Exception):
    """``train.on_divergence=rollback``: the run diverged, its checkpoints after the divergence are
    set aside; :func:`~moe_dist.train.loop.trainer.train` starts the trainer again with ``resume=auto``."""


@dataclasses.dataclass
class Divergence:
    """Bad steps from ``first_bad_step`` to ``stopped_at`` (non-finite, a loss or gradient-norm spike,
    a collapse), never a ``train.bad_step_window`` of steps without one between them; ``why``: the
    sentence that says what stopped the run."""

    first_bad_step: int
    stopped_at: int
    why: str


class RunHealth:
    """The divergence rules and their state. ``rollbacks``: this job's rollbacks so far (events,
    carried from one trainer to the next by :func:`~moe_dist.train.loop.trainer.train`); ``log``: rank 0's
    log lines."""

    def __init__(self, cfg: Config, run_dir: str, is_main: bool, log: Callable[[str], None],
                 rollbacks: Optional[list] = None):
        self.cfg, self.run_dir, self.is_main, self.log = cfg, run_dir, is_main, log
        self.rollbacks = rollbacks if rollbacks is not None else []
        self.reset({})

    def reset(self, counters: dict) -> None:
        """The counters a checkpoint keeps (``counters``: its meta.json's, empty on a fresh start)."""
        self.skipped_steps = int(counters.get("skipped_steps", 0))
        self.rollback_count = max(int(counters.get("rollbacks", 0)), len(self.rollbacks))
        self.recent_losses = deque(counters.get("recent_losses", []), maxlen=self.cfg.train.spike_window)
        self.recent_grad_norms = deque(counters.get("recent_grad_norms", []), maxlen=self.cfg.train.spike_window)
        self.last_loss: Optional[float] = counters.get("last_loss")  # the step before's, whatever its verdict
        self.bad_steps: deque[int] = deque()  # the bad steps within the last train.bad_step_window
        self.first_bad_step: Optional[int] = None

    def counters(self) -> dict:
        """What a checkpoint keeps of the run's health (JSON)."""
        return {"skipped_steps": self.skipped_steps, "rollbacks": self.rollback_count,
                "recent_losses": list(self.recent_losses), "recent_grad_norms": list(self.recent_grad_norms),
                "last_loss": self.last_loss}

    def take_up_divergence(self, step: int, checkpoints, sampler, metrics) -> None:
        """After ``resume=auto`` from before a divergence (a stop or a rollback): continue its counters,
        skip the ``sampler``'s batches up to its first bad step if ``train.skip_divergent_batches``, log
        the rollback (``metrics``: metrics.jsonl, the summary). Any other start only moves the record to
        its history. ``step``: the step resumed at; collective over the ``checkpoints``' group."""
        mine = read_record(self.run_dir)["pending"] if self.is_main else None
        pending = broadcast(mine, checkpoints.checkpointer.group)
        if pending is None:
            return
        skipped = 0
        if self.cfg.resume == "auto":
            self.skipped_steps = max(self.skipped_steps, int(pending.get("skipped_steps", 0)))
            automatic = bool(pending.get("automatic"))
            self.rollback_count = max(self.rollback_count, int(pending.get("rollbacks", 0)) + int(automatic))
            first = int(pending["first_bad_step"])
            if self.cfg.train.skip_divergent_batches and first > step:
                skipped = first - step
                sampler.skip_steps(skipped)
                self.log(f"resume: skipped the batches of steps {step + 1}..{first} (up to the first bad step "
                         "of the divergence; train.skip_divergent_batches=true)")
            event = {"first_bad_step": first, "stopped_at": pending.get("stopped_at", first), "resumed_at": step,
                     "skipped_batches": skipped, "automatic": automatic}
            if automatic:
                self.rollbacks.append(event)
            metrics.log({"step": step, "rollback": event})
        if self.is_main:
            take_pending(self.run_dir, step if self.cfg.resume == "auto" else None, skipped)

    def loss_spike(self, loss: float) -> bool:
        """``loss`` exceeds ``train.spike_factor`` x the median of the recent healthy losses (the same
        answer on every rank: the loss and the history are global figures)."""
        factor = self.cfg.train.spike_factor
        if factor is None or len(self.recent_losses) < self.recent_losses.maxlen:
            return False
        return loss > factor * statistics.median(self.recent_losses)

    def check_step(self, step: int, row: dict) -> Optional[Divergence]:
        """Count a bad step: skipped (a non-finite loss, gradient norm or router logits, a loss spike) or
        applied but a sign of divergence (:meth:`applied_bad_step`). ``train.max_nonfinite_steps`` of them
        within ``train.bad_step_window`` steps make the divergence that stops (or rolls back) training,
        raised once the step's metrics row is written; it began at the first bad step not followed by a
        whole window without one. An engine that did not skip a non-finite step stops at once, before
        anything is saved. ``row``: the step's figures (marked ``bad`` with the reason)."""
        cfg = self.cfg.train
        limit, window = cfg.max_nonfinite_steps, cfg.bad_step_window
        finite = math.isfinite(row["loss"]) and math.isfinite(row["aux_loss"]) and math.isfinite(row["grad_norm"])
        if not finite and not row.get("skipped"):
            return Divergence(self.first_bad_step or step, step,
                              f"step {step}: loss {row['loss']}, gradient norm {row['grad_norm']} are not finite "
                              f"and train.engine={cfg.engine} did not skip the update; stopped before saving")
        while self.bad_steps and self.bad_steps[0] <= step - window:
            self.bad_steps.popleft()
        why = self._bad_step_words(row) if row.get("skipped") else self.applied_bad_step(row)
        if math.isfinite(row["loss"]):
            self.last_loss = row["loss"]
        if why is None:
            if not self.bad_steps:
                self.first_bad_step = None
            self.recent_losses.append(row["loss"])
            self.recent_grad_norms.append(row["grad_norm"])
            return None
        row["bad"] = why
        self.bad_steps.append(step)
        if self.first_bad_step is None:
            self.first_bad_step = step
        if row.get("skipped"):
            self.skipped_steps += 1
        done = "the update was skipped" if row.get("skipped") else "the update (clipped) was applied"
        self.log(f"step {step}: {why}: {done} ({len(self.bad_steps)} bad step(s) within {window}, "
                 f"train.max_nonfinite_steps={limit})")
        if len(self.bad_steps) < limit:
            return None
        steps = ", ".join(map(str, self.bad_steps))
        return Divergence(self.first_bad_step, step,
                          f"training diverged: steps {steps} were bad ({limit} within {window} steps = "
                          f"train.max_nonfinite_steps within train.bad_step_window; a non-finite loss, gradient norm "
                          f"or router logits, a loss or gradient-norm spike, or a collapse)")

    def applied_bad_step(self, row: dict) -> Optional[str]:
        """Why an applied step is a sign of divergence, or None: its gradient norm beyond
        ``train.grad_spike_factor`` x the recent healthy median, or (``train.detect_collapse``) its loss
        back at ln(vocab) after training had brought it well below and not falling since the step before
        (a loss passing ln(vocab) on its way down is a run recovering), or a gradient of exactly zero after
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
        falling = self.last_loss is not None and row["loss"] < (1 - RECOVERING_DROP) * self.last_loss
        if median_loss < 0.9 * uniform and row["loss"] >= 0.98 * uniform and not falling:
            before = f"; {self.last_loss:.4f} the step before" if self.last_loss is not None else ""
            return (f"loss {row['loss']:.4f} is back at ln(vocab) = {uniform:.4f} (a uniform guess) after a median of "
                    f"{median_loss:.4f} over the last {len(self.recent_losses)} healthy steps{before}: the model "
                    "collapsed")
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

    def diverged(self, divergence: Divergence, checkpoints) -> TrainingDiverged:
        """Collective. Set aside the ``checkpoints`` after the last healthy state and record the
        divergence (rank 0); raise :class:`RollingBack` when ``train.on_divergence=rollback`` may roll
        back once more, else return the error that stops the run, naming the checkpoint
        ``resume=auto`` will take."""
        cfg = self.cfg.train
        checkpoints.wait()  # an async save in flight is set aside with the others
        good = last_good_step(divergence.first_bad_step)
        may_roll = cfg.on_divergence == "rollback" and self.rollback_count < cfg.max_rollbacks
        event = None
        if self.is_main:
            event = record_divergence(self.run_dir, {
                "first_bad_step": divergence.first_bad_step, "last_good_step": good, "stopped_at": divergence.stopped_at,
                "reason": divergence.why, "skipped_steps": self.skipped_steps, "rollbacks": self.rollback_count},
                rollback=may_roll)
        event = broadcast(event, checkpoints.checkpointer.group)
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


def state_is_finite(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rt: Runtime) -> bool:
    """Collective: every weight and optimizer state entry of every rank is finite (one read)."""
    tensors = [p for p in model.parameters()]
    tensors += [v for state in optimizer.state.values() for v in state.values()
                if torch.is_tensor(v) and v.is_floating_point()]
    flags = [torch.isfinite(t.to_local() if hasattr(t, "to_local") else t).all() for t in tensors]
    flags = [f.to(rt.device) for f in flags if f.device.type != "meta"]
    ok = torch.stack(flags).all() if flags else torch.ones((), dtype=torch.bool, device=rt.device)
    ok = ok.to(torch.int32).view(1)
    if rt.distributed:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())
