"""The trainer's checkpoints: what is saved at a step boundary, and the resume policy.

``resume=auto | none | <checkpoint or run directory>`` picks a checkpoint (rank 0 decides, the
others follow); before any tensor is read the checkpoint must be of the same model (the
structural ``model.*`` keys), tokenizer and data order; after a resume the run directory is
tidied (metrics rows after the resumed step, checkpoints of another timeline set aside).
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import time
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn as nn

from ...config import ConfigError
from ...safe_io import LOG_LIMIT, UnreadableFile, open_append, read_json_lines, write_atomically
from .checkpointer import Checkpointer, describe
from .collective import barrier, broadcast
from .divergence import RECORD, set_aside_pending
from .files import (DAMAGED_SUFFIX, META, CheckpointError, DamagedCheckpoint, latest_checkpoint, remove_leftovers,
                    scan, set_aside)
from .rng import rng_state
from .schema import TRAINER_META_FIELDS, check_meta
from .state import expert_keyed_state_dict, optimizer_state_dict

if TYPE_CHECKING:
    from ...distributed.bootstrap import Runtime

# model settings that decide the tensors' names and shapes: a checkpoint of another value is refused
STRUCTURAL_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "tie_embeddings", "qkv_bias",
                   "moe.layers", "moe.router", "moe.num_experts", "moe.d_ff", "moe.activation", "moe.shared_d_ff",
                   "moe.shared_gate", "moe.expert_bias")
# keys added later: a checkpoint written before them holds their default
ADDED_KEY_DEFAULTS = {"moe.shared_d_ff": None, "moe.shared_gate": False, "moe.expert_bias": False}
SCHEDULE_KEYS = ("lr", "min_lr_ratio", "warmup_steps", "steps")


def model_differences(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """``(structural, other)`` differences between two ``model`` config sections, as
    ``"model.<key>: checkpoint X, config Y"``."""
    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict) and k != "router_options":
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[prefix + k] = v
        return out

    a, b = {**ADDED_KEY_DEFAULTS, **flat(saved)}, {**ADDED_KEY_DEFAULTS, **flat(current)}
    structural, other = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            line = f"model.{key}: checkpoint {a.get(key)!r}, config {b.get(key)!r}"
            (structural if key in STRUCTURAL_KEYS else other).append(line)
    return structural, other


def resolve_resume(choice: str, run_dir: str) -> tuple[list[str], list[str], Optional[str]]:
    """``(checkpoints to try, in order, notes, error)`` for ``resume=choice``: auto (every complete
    checkpoint of ``run_dir``, newest first: a damaged one falls back to the one before), none, a
    checkpoint directory or a run directory (its latest; an explicit path is the only one tried).
    Reads only directory listings and manifests, so the command line checks it before launching."""
    notes: list[str] = []
    if choice == "none":
        return [], notes, None
    if choice == "auto":
        latest_checkpoint(run_dir, log=notes.append)  # notes on unfinished newer ones
        paths = [p for _step, p in reversed(scan(run_dir)[0])]
        if not paths:
            notes.append(f"resume=auto: no complete checkpoint in {os.path.join(run_dir, 'checkpoints')}; "
                         "starting from step 0")
        return paths, notes, None
    if not os.path.isdir(choice):
        return [], notes, (f"resume: {choice!r} is not a directory; allowed: auto, none, a checkpoint directory "
                           "(<run>/checkpoints/step_NNNNNN) or a run directory (its latest checkpoint)")
    if not os.path.exists(os.path.join(choice, META)) and os.path.isdir(os.path.join(choice, "checkpoints")):
        path = latest_checkpoint(choice, log=notes.append)
        if path is None:
            return [], notes, f"resume: run directory {choice!r} has no complete checkpoint"
        return [path], notes, None
    return [choice], notes, None


class TrainingCheckpoints:
    """What the trainer saves at a step boundary and how it resumes (``ckpt.*`` and ``resume``).

    Its parts, given explicitly: ``model`` and ``optimizer`` (a per-parameter optimizer; both
    loaded in place), ``sampler`` and ``diagnostics`` (``state_dict`` / ``load_state_dict``, kept
    in ``meta.json``), ``config`` (the resolved config as a dict: ``ckpt.*``, ``resume``, the
    model checks, saved in ``meta.json``), the tokenizer's SHA-256, ``lr_schedule`` (step ->
    learning rate), ``counters`` (the run's own JSON counters, kept in ``meta.json`` and given
    back as :attr:`loaded_counters` after a resume), ``runtime`` (ranks, device, data-parallel group) and ``log``. The step is an
    argument of :meth:`save` and the result of :meth:`resume`.
    """

    def __init__(self, run_dir: str, config: dict, *, runtime: "Runtime", model: nn.Module,
                 optimizer: torch.optim.Optimizer, sampler, tokenizer_sha256: str, lr_schedule: Callable[[int], float],
                 diagnostics=None, counters: Optional[Callable[[], dict]] = None, log: Callable[[str], None] = print):
        self.run_dir, self.config, self.rt = run_dir, config, runtime
        self.model, self.optimizer, self.sampler, self.diagnostics = model, optimizer, sampler, diagnostics
        self.tokenizer_sha256, self.lr_schedule, self.log = tokenizer_sha256, lr_schedule, log
        self.counters = counters
        ckpt = config["ckpt"]
        self.checkpointer = Checkpointer(run_dir, keep=ckpt["keep"], async_save=ckpt["async_save"],
                                         verify=ckpt["verify"], log=log)
        self.resumed_from: Optional[str] = None
        self.loaded_counters: dict = {}  # the resumed checkpoint's ``counters`` (empty on a fresh start)
        self.snapshots = None  # ckpt.memory_every: in-memory snapshots on this node and a buddy node
        if ckpt.get("memory_every"):
            from .snapshots import Snapshots

            self.snapshots = Snapshots(run_dir, config, tokenizer_sha256, log=log)

    # ---- save ------------------------------------------------------------------------------------------
    def meta(self, step: int) -> dict:
        rt, config = self.rt, self.config
        return {"sampler": self.sampler.state_dict(), "world_size": rt.world_size, "ep": rt.groups.ep_size,
                "vocab_size": config["model"]["vocab_size"], "tokenizer_sha256": self.tokenizer_sha256,
                "lr": self.lr_schedule(max(step - 1, 0)),
                "schedule": {k: config["train"][k] for k in SCHEDULE_KEYS},
                "config": config, "diagnostics": self._diagnostics_state(),
                "counters": self.counters() if self.counters is not None else {}}

    def _diagnostics_state(self) -> Optional[dict]:
        """The routing diagnostics' histories and the probe set's last assignments (JSON; gathered
        over the data-parallel ranks, so the first probe evaluation after a resume, in any
        layout, compares with them)."""
        if self.diagnostics is None:
            return None
        return self.diagnostics.state_dict(self.rt.groups.dp if self.rt.distributed else None)

    def save(self, step: int) -> str:
        """Collective: the checkpoint of the state after ``step`` optimizer steps; returns its directory."""
        return self.checkpointer.save(step, self.model, self.optimizer, meta=self.meta(step), config=self.config,
                                      rng_device=self.rt.device)

    def wait(self) -> None:
        self.checkpointer.wait()

    def snapshot(self, step: int) -> None:
        """Collective (the routing diagnostics are gathered): the in-memory snapshot of the state after
        ``step``; copied now, written to host memory and a buddy node in the background."""
        state = expert_keyed_state_dict(self.model)
        state.update(optimizer_state_dict(self.model, self.optimizer))
        state.update(rng_state(self.rt.rank, self.rt.device))
        manifest = describe(self.model, state, ["model", "optimizer", "rng"], self.config)
        self.snapshots.take(step, state, {"step": step, **self.meta(step)}, manifest)

    def end_snapshots(self) -> None:
        """Collective, at the normal end of a run: this run's snapshots removed from host memory."""
        if self.snapshots is not None:
            self.snapshots.end()

    # ---- resume ----------------------------------------------------------------------------------------
    def _resolve(self) -> tuple[list[str], list[str], Optional[str]]:
        """(checkpoints to try, in order, notes, error) for the ``resume`` setting; rank 0 only."""
        return resolve_resume(self.config["resume"], self.run_dir)

    def _check_compatible(self, path: str, meta: dict, manifest: dict) -> None:
        check_meta(meta, os.path.join(path, META), TRAINER_META_FIELDS)  # what a resume reads beyond the weights
        saved_model = (meta.get("config") or {}).get("model")
        if saved_model is not None:
            structural, other = model_differences(saved_model, self.config["model"])
            if structural:
                raise CheckpointError(f"checkpoint {path} is of another model, nothing was loaded: "
                                      + "; ".join(structural))
            if other:
                self.log(f"resume: settings changed since the checkpoint: {'; '.join(other)}")
        if meta.get("tokenizer_sha256") not in (None, self.tokenizer_sha256):
            raise CheckpointError(f"checkpoint {path} was trained with another tokenizer (sha256 "
                                  f"{meta['tokenizer_sha256'][:12]}...) than the data settings give now "
                                  f"({self.tokenizer_sha256[:12]}...); check the data.* keys")
        try:
            self.sampler.load_state_dict(meta["sampler"])
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path}: cannot continue its data order: {e}") from None

    def resume(self) -> int:
        """Collective. Apply ``resume`` (auto | a path | none): restore model, optimizer, sampler
        position and RNG states, then tidy the run directory (metrics rows after the resumed
        step, checkpoints of another timeline). Returns the step to continue from (0 when
        nothing was loaded); :attr:`resumed_from` is the checkpoint loaded, or None."""
        group = self.checkpointer.group
        decision = None
        if self.rt.is_main:
            for leftover, size in remove_leftovers(self.run_dir):  # first: they may hold the space we need
                self.log(f"checkpoint: removed {leftover}, left by a save that did not finish ({size / 2**20:.1f} MiB)")
            for aside in set_aside_pending(self.run_dir, self.log):  # a divergence's, deferred while `moe-dist eval` read
                self.log(f"checkpoint: set {os.path.basename(aside)} aside (written after the last trusted state "
                         "of the divergence recorded in divergence.json)")
            decision = self._resolve()
        paths, notes, error = broadcast(decision, group)
        for note in notes:
            self.log(note)
        if error:
            raise ConfigError(error)
        step, path = 0, None
        resumed = self._resume_from_snapshot(paths)
        if resumed is not None:
            paths, (step, path) = [], resumed
        for i, candidate in enumerate(paths):
            try:
                meta, manifest = self.checkpointer.load(
                    candidate, self.model, self.optimizer, rng_device=self.rt.device,
                    before_load=lambda m, man, c=candidate: self._check_compatible(c, m, man))
            except DamagedCheckpoint as e:
                if self.config["resume"] != "auto":
                    raise  # an explicit choice is refused, not replaced
                if self.rt.is_main:
                    aside = set_aside(candidate)
                    later = (f"falling back to {paths[i + 1]}" if i + 1 < len(paths)
                             else "no older one: starting from step 0")
                    self.log(f"resume=auto: skipped {candidate}: {e}; kept as {aside}; {later}")
                barrier(group)
                continue
            path = candidate
            step = int(meta["step"])
            if meta.get("diagnostics") and self.diagnostics is not None:
                self.diagnostics.load_state_dict(meta["diagnostics"])
            self.resumed_from = os.path.abspath(path)
            self.loaded_counters = dict(meta.get("counters") or {})
            self._report(path, step, meta, manifest)
            break
        if self.snapshots is not None:
            self.snapshots.forget_after(step)  # never a snapshot of another timeline taken for a newer one
        if self.rt.is_main:
            self._tidy(path, step, inside=resumed is not None)
        barrier(group)
        return step

    def _resume_from_snapshot(self, paths: list[str]) -> Optional[tuple[int, str]]:
        """Collective, under resume=auto with snapshots on: (step, where) after loading the newest complete
        in-memory snapshot newer than the newest disk checkpoint, or None (the disk path then)."""
        if self.snapshots is None or self.config["resume"] != "auto":
            return None
        if os.path.exists(os.path.join(self.run_dir, RECORD)):
            self.log(f"resume: {RECORD} records a divergence: in-memory snapshots are not used, only disk checkpoints")
            return None
        disk = int(os.path.basename(os.path.normpath(paths[0])).split("_")[-1]) if paths else 0
        t0 = time.monotonic()
        try:
            found = self.snapshots.restore(disk)
            if found is None:
                return None
            merged, step = found
            assembled = time.monotonic() - t0
            meta, manifest = self.checkpointer.load(
                merged, self.model, self.optimizer, rng_device=self.rt.device,
                before_load=lambda m, man: self._check_compatible(merged, m, man))
        except CheckpointError as e:
            if self.rt.is_main:
                self.log(f"resume: the in-memory snapshot was not used: {e}; the disk checkpoint is")
            return None
        self.snapshots.done_with(merged)
        if meta.get("diagnostics") and self.diagnostics is not None:
            self.diagnostics.load_state_dict(meta["diagnostics"])
        self.resumed_from = os.path.abspath(merged)
        self.loaded_counters = dict(meta.get("counters") or {})
        where = (f"the in-memory snapshot of step {step} ({merged}, newer than the disk checkpoint of step {disk}; "
                 f"found and assembled in {assembled:.1f} s, loaded in {time.monotonic() - t0 - assembled:.1f} s)")
        self._report(where, step, meta, manifest)
        return step, os.path.join(self.run_dir, "checkpoints", f"snapshot_{step:06d}")

    def _report(self, path: str, step: int, meta: dict, manifest: dict) -> None:
        train = self.config["train"]
        saved, now = manifest.get("layout", {}), {"world_size": self.rt.world_size, "ep": self.rt.groups.ep_size}
        self.log(f"resumed from {path} at step {step} (saved by {saved.get('world_size')} rank(s), ep="
                 f"{saved.get('ep')}, dense={saved.get('dense')}; now {now['world_size']} rank(s), ep={now['ep']}): "
                 f"model, optimizer state, sampler position ({meta['sampler']['consumed']} windows), step")
        schedule = meta.get("schedule") or {}
        changed = [f"train.{k}: {schedule[k]} -> {train[k]}" for k in SCHEDULE_KEYS
                   if k in schedule and schedule[k] != train[k]]
        if changed:
            self.log(f"resume: the learning-rate schedule differs from the checkpoint's ({'; '.join(changed)}); "
                     "it continues on the new schedule")
        w_saved = saved.get("world_size", 0)
        if "rng" not in manifest.get("contents", []):
            self.log("resume: the checkpoint has no RNG states; every rank keeps its fresh state")
        elif w_saved == now["world_size"]:
            self.log("resume: every rank restored the RNG states saved by the rank of the same index")
        else:
            kept = min(w_saved, now["world_size"])
            self.log(f"resume: RNG states restored on ranks 0..{kept - 1} (saved by {w_saved} ranks"
                     + (f"; the states of ranks {kept}..{w_saved - 1} are unused" if w_saved > kept else
                        f"; ranks {kept}..{now['world_size'] - 1} keep their fresh state")
                     + "). The data order and routing noise depend only on (train.seed, step, global token index), "
                       "not on RNG states or the number of ranks, so training continues the same at any layout")

    def _keep_metrics_rows(self, metrics: str, step: int) -> None:
        """Rewrite metrics.jsonl with its rows up to ``step``; lines that are not whole rows (a crash or a
        full disk cut the last one) go to metrics.jsonl.damaged, said in one line."""
        try:
            rows, bad = read_json_lines(metrics, LOG_LIMIT)
        except UnreadableFile as e:
            aside = set_aside(metrics)
            self.log(f"resume: {e}; set aside as {aside}, the run starts a new metrics.jsonl")
            return
        kept = [row for row in rows if _row_step(row) is not None and _row_step(row) <= step]
        bad += [(None, json.dumps(row), "no integer step") for row in rows if _row_step(row) is None]
        if bad:
            damaged = metrics + DAMAGED_SUFFIX
            with open_append(damaged) as f:
                f.writelines(line + "\n" for _n, line, _why in bad)
            numbered = [str(n) for n, _line, _why in bad if n is not None]
            where = f"line(s) {', '.join(numbered[:5])}{' ...' if len(numbered) > 5 else ''}: " if numbered else ""
            self.log(f"resume: {metrics}: {len(bad)} line(s) not a whole metrics row ({where}{bad[0][2]}; cut short by a "
                     f"crash or a full disk?); kept in {damaged}, the {len(kept)} whole row(s) up to step {step} kept")
        write_atomically(metrics, "".join(json.dumps(row) + "\n" for row in kept))

    def _tidy(self, path: Optional[str], step: int, inside: bool = False) -> None:
        """Rank 0, after a successful resume (or a fresh start): metrics.jsonl keeps the rows up to
        the resumed step; checkpoints of another timeline (newer than the resumed step, or all of
        them on a fresh start / a resume from elsewhere) are moved to checkpoints.superseded-<time>."""
        metrics = os.path.join(self.run_dir, "metrics.jsonl")
        if path is None and os.path.lexists(metrics):
            os.remove(metrics)
        elif path is not None and os.path.lexists(metrics):
            self._keep_metrics_rows(metrics, step)
        own_root = os.path.realpath(os.path.join(self.run_dir, "checkpoints"))
        inside = inside or (path is not None and os.path.realpath(os.path.dirname(os.path.normpath(path))) == own_root)
        limit = step if inside else -1
        complete, incomplete = scan(self.run_dir)
        stale = [p for saved, p in complete if saved > limit]
        for saved, p, _why in incomplete:
            if saved > limit and p.endswith(".partial"):
                shutil.rmtree(p, ignore_errors=True)
        if stale:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
            aside = os.path.join(self.run_dir, f"checkpoints.superseded-{stamp}")
            os.makedirs(aside, exist_ok=True)
            for p in stale:
                os.rename(p, os.path.join(aside, os.path.basename(p)))
            names = ", ".join(os.path.basename(p) for p in stale)
            self.log(f"checkpoint: moved {len(stale)} checkpoint(s) of an earlier run ({names}) to {aside}, "
                     "so that resume=auto never mixes two runs")


def _row_step(row: dict) -> Optional[int]:
    step = row.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None
