"""Collective save and load of one checkpoint with torch.distributed.checkpoint (DCP).

A checkpoint is one DCP state dict whose keys do not depend on the parallel layout (see
:mod:`.state` for the model and optimizer keys, :mod:`.rng` for the RNG states), plus
``meta.json`` (what the caller adds: step, data sampler position, schedule, config) and the
manifest. Files and crash safety (partial directory, manifest, atomic rename, checksums) are
in :mod:`.files`. Before anything is read, the loader checks the marker, every file's size
and checksum, the caller's checks, and that every tensor the model needs is in the file with
its shape. ``async_save`` copies the state to CPU memory and writes it in a background thread
over a separate gloo process group while training goes on.
"""
from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import shutil
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from ...distributed.groups import new_group
from ...exits import JobStopped
from ..setup.run_lock import readers_excluded
from .collective import agree, all_gather, collectively, distributed, around_dcp
from .files import (FORMAT, FORMAT_VERSION, MARKER, META, CheckpointError, DamagedCheckpoint, SafeFileSystemReader,
                    check_files, corrupted_error, data_files, file_record, partial_dir, prune, publish, read_manifest,
                    read_meta, shard, start_partial, step_dir, write_json_durably)
from .rng import RNG, rng_prefix, rng_state, set_rng_state
from .state import (OPTIM, expert_keyed_state_dict, expert_layers, global_keys, init_optimizer_state,
                    optimizer_state_dict, split_optim_key)


def config_sha256(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def _layout(model: nn.Module, state: dict) -> dict:
    world = dist.get_world_size() if distributed() else 1
    layers = list(expert_layers(model).values())
    ep = layers[0].num_experts // layers[0].experts.num_experts if layers else 1
    dense = "fsdp" if any(type(t).__name__ == "DTensor" for t in state.values()) else ("replicated" if world > 1 else "local")
    dims = {p.dim for layer in layers for w in layer.experts.expert_parameters()
            for p in getattr(w, "placements", ()) if type(p).__name__ == "Shard"}
    split = "none" if not dims else "experts" if dims == {0} else "within"  # how each expert is split over edp (a record)
    return {"world_size": world, "ep": ep, "edp": world // ep, "dp": world, "dense": dense, "expert_split": split}


def describe(model: nn.Module, state: dict, contents: list[str], config: Optional[dict]) -> dict:
    """The manifest's description of a state dict: contents, layout, experts, config digests."""
    out = {"contents": contents, "layout": _layout(model, state), "torch": torch.__version__,
           "experts": {prefix: layer.num_experts for prefix, layer in expert_layers(model).items()}}
    if config is not None:
        out["config_sha256"] = config_sha256(config)
        out["model_config_sha256"] = config_sha256(config.get("model", {}))
    return out


class NoSpaceLeft(JobStopped):
    """A save failed for lack of disk space (one line: where, how much was needed and is free)."""


_FULL = ("No space left on device", "Disk quota exceeded")


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or a cause, or a rank's failure inside DCP's CheckpointException) is ENOSPC / EDQUOT."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(words in str(e) for words in _FULL):
            return True
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f if isinstance(f, BaseException) else getattr(f, "exc_value", None) for f in failures.values()]
    return False


def out_of_space(partial: str, need: int) -> bool:
    """After a failed save: what it still had to write exceeds the free space (torch.save's zip
    writer reports ENOSPC as "unexpected pos", without the errno)."""
    root = os.path.dirname(partial)
    if not need or not os.path.isdir(root):
        return False
    written = sum(os.path.getsize(os.path.join(partial, n)) for n in os.listdir(partial)
                  if os.path.isfile(os.path.join(partial, n))) if os.path.isdir(partial) else 0
    return shutil.disk_usage(root).free < need - written


def _local_bytes(state: dict) -> int:
    total = 0
    for v in state.values():
        if torch.is_tensor(v):
            local = v.to_local() if hasattr(v, "to_local") else v
            total += local.numel() * local.element_size()
    return total


def no_space_error(partial: str, step: int, need: int) -> NoSpaceLeft:
    root = os.path.dirname(partial)
    free = shutil.disk_usage(root).free if os.path.isdir(root) else 0
    return NoSpaceLeft(f"cannot save the checkpoint of step {step}: no space left on the device of {root} (the save "
                       f"needs about {need / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free there now); free some "
                       f"space, then resume=auto continues from the last complete checkpoint (it first removes the "
                       f"unfinished {os.path.basename(partial)})")


# ---- the checkpointer ------------------------------------------------------------------------------
class Checkpointer:
    """Collective save / load of a model (+ optimizer, RNG) under ``<run_dir>/checkpoints``.

    keep: complete checkpoints kept (0 = all), pruned only after a newer one is complete.
    async_save: write in a background thread (over a separate gloo group) after copying the state
        to CPU memory; at most one save is in flight; :meth:`wait` finishes it.
    verify: check every file's SHA-256 against the manifest before loading (sizes are always checked).
    """

    def __init__(self, run_dir: str, *, keep: int = 0, async_save: bool = False, verify: bool = True,
                 log: Callable[[str], None] = lambda _m: None):
        self.run_dir, self.keep, self.async_save, self.verify, self.log = run_dir, keep, async_save, verify, log
        self.rank = dist.get_rank() if distributed() else 0
        self.world = dist.get_world_size() if distributed() else 1
        # checkpoint collectives exchange small host objects: a gloo group of their own when the training's
        # is not gloo, and always for async saves (their collectives run in a background thread)
        self.group = None
        if distributed() and (async_save or dist.get_backend() != "gloo"):
            self.group = new_group(backend="gloo", name="checkpoint")
        self._thread: Optional[threading.Thread] = None
        self._pending: Optional[tuple[int, str]] = None  # (step, final path) of the save in flight
        self._error: Optional[BaseException] = None
        self._need = 0

    # ---- save ------------------------------------------------------------------------------------------
    def save(self, step: int, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
             meta: Optional[dict] = None, config: Optional[dict] = None, rng_device: Optional[torch.device] = None) -> str:
        """Collective: every rank calls it. Returns the checkpoint's final directory (complete
        once this returns, or, with async_save, once :meth:`wait` returns). A full disk raises
        :class:`NoSpaceLeft` on every rank."""
        try:
            return self._save(step, model, optimizer, meta=meta, config=config, rng_device=rng_device)
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            partial = partial_dir(self.run_dir, step)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            if not (disk_full(e) or out_of_space(partial, self._need)):
                raise
            raise no_space_error(partial, step, self._need) from None

    def _save(self, step: int, model: nn.Module, optimizer: Optional[torch.optim.Optimizer], *, meta: Optional[dict],
              config: Optional[dict], rng_device: Optional[torch.device]) -> str:
        final = step_dir(self.run_dir, step)
        if self._pending is not None and self._pending[0] == step:
            self.wait()  # this step is already being saved (e.g. a preemption right after a periodic save)
            return final
        self.wait()
        state = expert_keyed_state_dict(model)
        contents = ["model"]
        if optimizer is not None:
            state.update(optimizer_state_dict(model, optimizer))
            contents.append("optimizer")
        if rng_device is not None:
            state.update(rng_state(self.rank, rng_device))
            contents.append("rng")
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "step": step, **describe(model, state, contents, config)}
        expected = [k for k in global_keys(model, state) if not k.startswith(RNG)]
        self._need = _local_bytes(state) * self.world  # for the message of a full disk (ranks hold similar shares)
        meta = {"step": step, **(meta or {})}
        partial = partial_dir(self.run_dir, step)
        error = None
        if self.rank == 0:
            try:
                start_partial(self.run_dir, step)
            except OSError as e:
                error = f"cannot create {partial}: {e}"
        agree(error, self.group)
        if self.async_save:
            with around_dcp():
                future = dcp.async_save(state, checkpoint_id=partial, process_group=self.group, no_dist=not distributed())
            self._pending, self._error = (step, final), None
            self._thread = threading.Thread(target=self._finish_in_background,
                                            args=(future, partial, final, meta, manifest, expected),
                                            name=f"checkpoint-step-{step}", daemon=True)
            self._thread.start()
        else:
            with around_dcp():
                dcp.save(state, checkpoint_id=partial, process_group=self.group, no_dist=not distributed())
            self._finish(partial, final, meta, manifest, expected)
        return final

    def _finish_in_background(self, future, *args) -> None:
        try:
            future.result()
            self._finish(*args)
        except BaseException as e:  # noqa: BLE001 - handed to wait() on the training thread
            self._error = e

    def _finish(self, partial: str, final: str, meta: dict, manifest: dict, expected: list[str]) -> None:
        """After the DCP files are written: meta.json, checksums (each rank hashes a share of the
        files), a check that every global expert is in the file, the manifest, the rename."""
        error = None
        if self.rank == 0:
            try:
                write_json_durably(os.path.join(partial, META), meta)
            except OSError as e:
                error = f"cannot write {os.path.join(partial, META)}: {e}"
        agree(error, self.group)  # (a barrier: every rank's files, and meta.json, are written)
        names, mine = data_files(partial), {}
        try:
            mine = {n: file_record(os.path.join(partial, n)) for n in shard(names, self.rank, self.world)}
        except OSError as e:
            error = f"cannot read back {partial}: {e}"
        records = {}
        for parts, problem in all_gather((mine, error), self.group):
            records.update(parts)
            error = error or problem
        if error:  # every rank has the same gathered reports
            raise CheckpointError(error)
        if self.rank == 0:
            try:
                saved = SafeFileSystemReader(partial).read_metadata().state_dict_metadata
                missing = sorted(set(expected) - set(saved))
                if missing:  # a layout bug must never produce a checkpoint that silently lacks experts
                    raise CheckpointError(f"the save of {final} lacks {len(missing)} tensor(s) the model has, e.g. "
                                          f"{missing[:4]}; it was not completed")
                if sorted(records) != names:
                    raise CheckpointError(f"the save of {final}: checksums missing for {sorted(set(names) - set(records))}")
                manifest = {**manifest, "files": records, "tensors": len(saved),
                            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
                write_json_durably(os.path.join(partial, MARKER), manifest)
                publish(partial, final)
                with readers_excluded(self.run_dir) as alone:  # never delete what `moe-dist eval` is reading
                    if alone:
                        prune(self.run_dir, self.keep, self.log)
                    elif self.keep:
                        self.log(f"checkpoint: older checkpoints kept for now (ckpt.keep={self.keep}): `moe-dist eval` "
                                 "is reading the run directory")
            except (OSError, CheckpointError) as e:
                error = str(e)
        agree(error, self.group)

    def wait(self) -> None:
        """Finish the save in flight, if any (collective when one is in flight); re-raise its error."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        pending, self._pending = self._pending, None
        error, self._error = self._error, None
        if error is not None:
            if pending and (disk_full(error) or out_of_space(partial_dir(self.run_dir, pending[0]), self._need)):
                raise no_space_error(partial_dir(self.run_dir, pending[0]), pending[0], self._need) from None
            raise error

    @property
    def saving(self) -> Optional[int]:
        """The step of the save in flight, or None."""
        return self._pending[0] if self._pending else None

    # ---- load ------------------------------------------------------------------------------------------
    def verify_files(self, path: str, manifest: dict) -> None:
        """Collective: each rank checks a share of the files; all raise if any is damaged."""
        names = sorted(manifest["files"])
        problems = check_files(path, manifest, shard(names, self.rank, self.world), checksums=self.verify)
        found = [p for part in all_gather(problems, self.group) for p in part]
        if found:
            raise corrupted_error(path, found)

    def load(self, path: str, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
             rng_device: Optional[torch.device] = None, before_load: Optional[Callable[[dict, dict], None]] = None
             ) -> tuple[dict, dict]:
        """Collective: load the model (and optimizer state, and this rank's RNG states when
        ``rng_device`` is given and the checkpoint has them) in place. Returns ``(meta, manifest)``.

        Everything is checked before any tensor is read: the marker, every file's size and
        checksum, ``before_load(meta, manifest)`` (the caller's checks), and every tensor the
        model needs (all global experts, right shapes). A refusal raises :class:`CheckpointError`
        on every rank and changes nothing on disk."""
        manifest = collectively(lambda: read_manifest(path), self.group)
        self.verify_files(path, manifest)
        # after the checksums: a damaged meta.json is reported as damaged, not as a field of another type
        meta = collectively(lambda: read_meta(path), self.group)
        if before_load is not None:
            collectively(lambda: before_load(meta, manifest), self.group)
        if optimizer is not None and "optimizer" not in manifest.get("contents", []):
            raise CheckpointError(f"{path} holds model weights only (no optimizer state), so training cannot continue "
                                  "exactly from it; start from its weights with `moe-dist convert` + ckpt.init_from")
        reader = SafeFileSystemReader(path)
        saved = collectively(lambda: reader.read_metadata().state_dict_metadata, self.group)
        state = expert_keyed_state_dict(model)
        collectively(lambda: _check_model_tensors(path, saved, model, state), self.group)
        if optimizer is not None:
            init_optimizer_state(model, optimizer, saved)
            optim = optimizer_state_dict(model, optimizer)
            collectively(lambda: _check_optimizer(path, model, saved, global_keys(model, optim)), self.group)
            state.update(optim)
        rng = {}
        if rng_device is not None:
            rng = {k: v for k, v in rng_state(self.rank, rng_device).items() if k in saved}
            if rng_prefix(self.rank) + "torch_cpu" not in rng:
                rng = {}
            collectively(lambda: _check_like(path, saved, rng), self.group)
            state.update(rng)
        with around_dcp():
            try:
                dcp.load(state, storage_reader=reader, process_group=self.group, no_dist=not distributed())
            except dcp.api.CheckpointException as e:
                refusal = _refusal_inside(e)
                if refusal is None:
                    raise
                raise refusal from None
        if rng:
            set_rng_state(self.rank, rng_device, rng)
        return meta, manifest


def check_model_tensors(path: str, model: nn.Module) -> None:
    """Refuse (naming the tensors) a checkpoint whose model tensors are not those of ``model`` (which may
    be on the meta device: a caller checks before it allocates anything)."""
    saved = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    _check_model_tensors(path, saved, model, expert_keyed_state_dict(model))


def _check_model_tensors(path: str, saved: dict, model: nn.Module, state: dict) -> None:
    _check_tensors(path, saved, global_keys(model, state), {k for k in saved if not k.startswith((OPTIM, RNG))},
                   "model")


def _fmt_keys(keys: list[str]) -> str:
    return f"{', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''} ({len(keys)})"


def _check_tensors(path: str, saved: dict, wanted: dict[str, tuple], saved_model_keys: set[str], what: str) -> None:
    """Refuse unless the checkpoint has exactly the tensors ``wanted`` (over all ranks), with those shapes."""
    missing = sorted(k for k in wanted if k not in saved)
    unexpected = sorted(saved_model_keys - set(wanted))
    wrong = [f"{k} (checkpoint {list(saved[k].size)}, model {list(shape)})" for k, shape in wanted.items()
             if k in saved and tuple(saved[k].size) != tuple(shape)]
    problems = []
    if missing:
        problems.append(f"missing {what} tensors {_fmt_keys(missing)}")
    if unexpected:
        problems.append(f"tensors this model does not have {_fmt_keys(unexpected)}")
    if wrong:
        problems.append(f"other shapes: {_fmt_keys(wrong)}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match the model built from the config, nothing was loaded: "
                              + "; ".join(problems))


def _check_like(path: str, saved: dict, state: dict[str, torch.Tensor]) -> None:
    """Entries outside the model's and optimizer's (the RNG states) must have the shape and dtype
    this process's own generators have."""
    wrong = [f"{k} (checkpoint {list(saved[k].size)} {saved[k].properties.dtype}, here {list(v.shape)} {v.dtype})"
             for k, v in state.items() if tuple(saved[k].size) != tuple(v.shape) or saved[k].properties.dtype != v.dtype]
    if wrong:
        raise DamagedCheckpoint(f"checkpoint {path}: entries of another shape or dtype than this process's: "
                                f"{_fmt_keys(wrong)}; nothing was loaded")


def _refusal_inside(exc: BaseException) -> Optional[CheckpointError]:
    """The reader's refusal (a CheckpointError raised on some rank) inside DCP's CheckpointException,
    which every rank receives; None when the failure was something else (kept as an internal error)."""
    for failure in getattr(exc, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, CheckpointError):
            return inner
    return None


def _check_optimizer(path: str, model: nn.Module, saved: dict, wanted: dict[str, tuple]) -> None:
    """Optimizer state: every saved entry belongs to a parameter of the model, expert state is
    there for every global expert, shapes match."""
    params = {fqn for fqn, _ in model.named_parameters()}
    saved_optim = {k for k in saved if k.startswith(OPTIM)}
    strangers = sorted(k for k in saved_optim if split_optim_key(k)[0] not in params)
    if strangers:
        raise CheckpointError(f"checkpoint {path} has optimizer state for parameters this model does not have: "
                              f"{_fmt_keys(strangers)}")
    _check_tensors(path, saved, wanted, saved_optim, "optimizer")


# ---- the first version's API (model weights) -------------------------------------------------------
def save_checkpoint(model: nn.Module, run_dir: str, step: int, meta: dict,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> str:
    """Collective: every rank calls it. Writes ``<run_dir>/checkpoints/step_<step>`` crash-safely
    (meta.json = ``{"step": step, **meta}``); returns its directory. Rank 0 of torch.distributed
    (or the only process) writes the shared files."""
    return Checkpointer(run_dir).save(step, model, optimizer, meta=meta)


def load_checkpoint(model: nn.Module, path: str, optimizer: Optional[torch.optim.Optimizer] = None,
                    verify: bool = True) -> dict:
    """Load model weights (and optimizer state) in place, at any layout (collective under
    torch.distributed); returns meta.json. Refuses incomplete, damaged or mismatched checkpoints."""
    meta, _ = Checkpointer(os.path.dirname(os.path.dirname(path)), verify=verify).load(path, model, optimizer)
    return meta


