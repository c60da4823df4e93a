"""Checkpoints with torch.distributed.checkpoint (DCP), independent of the parallel layout.

What a checkpoint holds (one DCP state dict, keys independent of the layout):

* the model: ``model.state_dict()`` names, with each ``[E_local, ...]`` expert tensor replaced
  by one entry per *global* expert (``blocks.0.ffn.experts.w1.expert_5``), so a checkpoint
  written at one expert-parallel size loads at any other; replicas of an expert
  (expert-data-parallel ranks) write it once. Router state lives in the model's parameters
  and buffers (Symphony's graph, AC running statistics, HyperRouter embedding and frozen
  hypernetwork). Dense weights are saved as they are (DTensor shards under FSDP2, plain
  tensors otherwise); DCP reshards them on load.
* the optimizer: ``optim.<parameter>.<state>`` (AdamW ``step``, ``exp_avg``, ``exp_avg_sq``),
  expert state split and keyed by global expert exactly like the weights
  (``optim.blocks.0.ffn.experts.w1.exp_avg.expert_5``), so it reshards too.
* the RNG states of every rank: ``rng.rank_00003.torch_cpu`` etc. (restored on the rank of the
  same index when it exists; nothing the training computes depends on them, see
  :meth:`TrainingCheckpoints.resume`).
* ``meta.json``: step, data sampler position, learning-rate schedule, layout, the resolved config.

Files and crash safety (partial directory, manifest, atomic rename, checksums) are in
:mod:`moe_dist.train.ckpt_files`. ``ckpt.async_save`` copies the state to CPU memory and
writes it in a background thread over a separate gloo process group while training goes on.
"""
from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import random
import re
import shutil
import threading
import warnings
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from ..moe import MoELayer
from .ckpt_files import (MARKER, CheckpointError, IncompleteCheckpoint, check_files, corrupted_error, data_files,
                         file_record, latest_checkpoint, partial_dir, prune, publish, read_manifest, scan, shard,
                         start_partial, step_dir, write_json_durably, FORMAT, FORMAT_VERSION, SafeFileSystemReader)

COMPLETE = MARKER  # the completion marker's file name (kept for callers of the first version)
OPTIM = "optim."
RNG = "rng."
META = "meta.json"
_EXPERT_SUFFIX = re.compile(r"\.expert_(\d+)$")
# model settings that decide the tensors' names and shapes: a checkpoint of another value is refused
STRUCTURAL_KEYS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "tie_embeddings", "qkv_bias",
                   "moe.layers", "moe.router", "moe.num_experts", "moe.d_ff", "moe.activation")

__all__ = ["COMPLETE", "CheckpointError", "IncompleteCheckpoint", "Checkpointer", "TrainingCheckpoints",
           "expert_keyed_state_dict", "optimizer_state_dict", "latest_checkpoint", "load_checkpoint",
           "save_checkpoint", "step_dir"]


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it 'assumes a single process' when torch.distributed is not started: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


# ---- layout-independent state dicts ------------------------------------------------------------------
def _expert_layers(model: nn.Module) -> dict[str, MoELayer]:
    """``"<layer>.experts"`` (the experts' state-dict prefix) -> its MoE layer."""
    return {f"{name}.experts" if name else "experts": m for name, m in model.named_modules() if isinstance(m, MoELayer)}


def expert_keyed_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with each ``[E_local, ...]`` expert tensor replaced by one view per
    global expert. The views share storage with the parameters, so loading into this dict
    loads the model in place."""
    sd = model.state_dict()
    for prefix, layer in _expert_layers(model).items():
        experts = layer.experts
        for pname in ("w1", "w3", "w2"):
            w = getattr(experts, pname)
            if w is None:
                continue
            key = f"{prefix}.{pname}"
            del sd[key]
            for g, view in experts.held(w.data):
                sd[f"{key}.expert_{g}"] = view
    return sd


def _expert_owners(model: nn.Module) -> dict[int, "nn.Module"]:
    """id(expert parameter) -> its GroupedExperts."""
    return {id(p): layer.experts for layer in _expert_layers(model).values() for p in layer.experts.expert_parameters()}


def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state as ``optim.<parameter name>.<state>``; expert state
    (``[E_local, ...]`` like its parameter) as one view per global expert, ``...<state>.expert_<g>``.
    Hyperparameters are not saved: they come from the config (the learning rate from the schedule)."""
    owners = _expert_owners(model)
    out = {}
    for fqn, p in model.named_parameters():
        state = optimizer.state.get(p)
        if not state:
            continue
        experts = owners.get(id(p))
        for name, value in state.items():
            if not torch.is_tensor(value):
                raise TypeError(f"optimizer state {name!r} of {fqn} is a {type(value).__name__}; only tensor state "
                                "can be checkpointed")
            key = f"{OPTIM}{fqn}.{name}"
            if experts is not None and value.dim() > 0:
                if value.shape != p.shape:
                    raise ValueError(f"optimizer state {name!r} of expert parameter {fqn} has shape {list(value.shape)}, "
                                     f"not the parameter's {list(p.shape)}")
                for g, view in experts.held(value):
                    out[f"{key}.expert_{g}"] = view
            else:
                out[key] = value
    return out


def _split_optim_key(key: str) -> tuple[str, str, Optional[int]]:
    """``optim.<fqn>.<state>[.expert_<g>]`` -> (fqn, state, g or None)."""
    rest = key[len(OPTIM):]
    m = _EXPERT_SUFFIX.search(rest)
    expert = None
    if m:
        expert, rest = int(m.group(1)), rest[: m.start()]
    fqn, _, state = rest.rpartition(".")
    return fqn, state, expert


def _init_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Create (zero) state for the parameters the checkpoint has state for, so DCP can load into it.
    Scalars (AdamW's ``step``) go where the optimizer keeps them: on the CPU unless capturable/fused."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    params = dict(model.named_parameters())
    wanted: dict[str, dict[str, object]] = {}
    for key, md in saved.items():
        if key.startswith(OPTIM):
            fqn, state, _ = _split_optim_key(key)
            wanted.setdefault(fqn, {})[state] = md
    for fqn, states in wanted.items():
        p = params.get(fqn)
        if p is None or id(p) not in group_of or optimizer.state.get(p):
            continue
        group = group_of[id(p)]
        new = {}
        for state, md in states.items():
            if len(md.size) == 0:
                device = p.device if group.get("capturable") or group.get("fused") else torch.device("cpu")
                new[state] = torch.zeros((), dtype=md.properties.dtype, device=device)
            else:
                new[state] = torch.zeros_like(p, memory_format=torch.preserve_format)
        optimizer.state[p] = new


def _global_keys(model: nn.Module, local: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Every key (with its global shape) the whole model's state has over all ranks: this rank's
    keys with expert keys expanded to every global expert of their layer."""
    totals = {prefix: layer.num_experts for prefix, layer in _expert_layers(model).items()}
    out = {}
    for key, t in local.items():
        m = _EXPERT_SUFFIX.search(key)
        base = key[len(OPTIM):] if key.startswith(OPTIM) else key
        total = next((n for prefix, n in totals.items() if base.startswith(prefix + ".")), None) if m else None
        shape = tuple(t.shape)
        if total is None:
            out[key] = shape
        else:
            stem = key[: m.start()]
            for g in range(total):
                out[f"{stem}.expert_{g}"] = shape
    return out


# ---- RNG states ----------------------------------------------------------------------------------
def _rng_prefix(rank: int) -> str:
    return f"{RNG}rank_{rank:05d}."


def rng_state(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This process's torch (CPU and accelerator), numpy and Python RNG states, as tensors."""
    p = _rng_prefix(rank)
    out = {p + "torch_cpu": torch.get_rng_state()}
    if device.type != "cpu":
        out[p + f"torch_{device.type}"] = torch.get_device_module(device.type).get_rng_state(device)
    _kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out[p + "numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    out[p + "numpy_pos"] = torch.tensor([pos, has_gauss], dtype=torch.int64)
    out[p + "numpy_gauss"] = torch.tensor([gauss], dtype=torch.float64)
    _version, internal, gauss_next = random.getstate()
    out[p + "python_state"] = torch.tensor(internal, dtype=torch.int64)
    out[p + "python_gauss"] = torch.tensor([gauss_next is not None, gauss_next or 0.0], dtype=torch.float64)
    return out


def set_rng_state(rank: int, device: torch.device, state: dict[str, torch.Tensor]) -> None:
    p = _rng_prefix(rank)
    torch.set_rng_state(state[p + "torch_cpu"])
    if device.type != "cpu" and p + f"torch_{device.type}" in state:
        torch.get_device_module(device.type).set_rng_state(state[p + f"torch_{device.type}"], device)
    pos, has_gauss = (int(v) for v in state[p + "numpy_pos"])
    np.random.set_state(("MT19937", state[p + "numpy_keys"].numpy().astype(np.uint32), pos, has_gauss,
                         float(state[p + "numpy_gauss"][0])))
    flag, value = (float(v) for v in state[p + "python_gauss"])
    random.setstate((3, tuple(int(v) for v in state[p + "python_state"]), value if flag else None))


# ---- small collective helpers --------------------------------------------------------------------
def _all_gather(obj, group) -> list:
    if not _distributed():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _collectively(fn: Callable, group):
    """``fn()`` on every rank; if it raises on any rank, a CheckpointError with that message is raised
    on all, so no rank waits in a later collective."""
    result, error = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - reported to every rank
        error = e
        if not isinstance(e, CheckpointError):
            error = CheckpointError(f"{type(e).__name__}: {e}")
            error.__cause__ = e
    reports = [r for r in _all_gather(None if error is None else (isinstance(error, IncompleteCheckpoint), str(error)),
                                      group) if r]
    if error is not None:
        raise error
    if reports:
        incomplete, message = reports[0]
        raise (IncompleteCheckpoint if incomplete else CheckpointError)(message)
    return result


def _agree(error: Optional[str], group) -> None:
    """Raise the same CheckpointError on every rank if any rank reports an error."""
    errors = [e for e in _all_gather(error, group) if e]
    if errors:
        raise CheckpointError(errors[0] if len(set(errors)) == 1 else " | ".join(dict.fromkeys(errors)))


def _barrier(group) -> None:
    if _distributed():
        dist.barrier(group=group)


def _broadcast(obj, group):
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def config_sha256(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def _layout(model: nn.Module, state: dict) -> dict:
    world = dist.get_world_size() if _distributed() else 1
    layers = list(_expert_layers(model).values())
    ep = layers[0].num_experts // layers[0].experts.num_experts if layers else 1
    dense = "fsdp" if any(type(t).__name__ == "DTensor" for t in state.values()) else ("replicated" if world > 1 else "local")
    return {"world_size": world, "ep": ep, "edp": world // ep, "dp": world, "dense": dense}


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
        self.rank = dist.get_rank() if _distributed() else 0
        self.world = dist.get_world_size() if _distributed() else 1
        # checkpoint collectives exchange small host objects: a gloo group of their own when the training's
        # is not gloo, and always for async saves (their collectives run in a background thread)
        self.group = None
        if _distributed() and (async_save or dist.get_backend() != "gloo"):
            self.group = dist.new_group(backend="gloo")
        self._thread: Optional[threading.Thread] = None
        self._pending: Optional[tuple[int, str]] = None  # (step, final path) of the save in flight
        self._error: Optional[BaseException] = None

    # ---- save ------------------------------------------------------------------------------------------
    def save(self, step: int, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
             meta: Optional[dict] = None, config: Optional[dict] = None, rng_device: Optional[torch.device] = None) -> str:
        """Collective: every rank calls it. Returns the checkpoint's final directory (complete
        once this returns, or, with async_save, once :meth:`wait` returns)."""
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
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "step": step, "contents": contents,
                    "layout": _layout(model, state), "torch": torch.__version__,
                    "experts": {prefix: layer.num_experts for prefix, layer in _expert_layers(model).items()}}
        if config is not None:
            manifest["config_sha256"] = config_sha256(config)
            manifest["model_config_sha256"] = config_sha256(config.get("model", {}))
        expected = [k for k in _global_keys(model, state) if not k.startswith(RNG)]
        meta = {"step": step, **(meta or {})}
        partial = partial_dir(self.run_dir, step)
        error = None
        if self.rank == 0:
            try:
                start_partial(self.run_dir, step)
            except OSError as e:
                error = f"cannot create {partial}: {e}"
        _agree(error, self.group)
        if self.async_save:
            with _quiet_single_process():
                future = dcp.async_save(state, checkpoint_id=partial, process_group=self.group, no_dist=not _distributed())
            self._pending, self._error = (step, final), None
            self._thread = threading.Thread(target=self._finish_in_background,
                                            args=(future, partial, final, meta, manifest, expected),
                                            name=f"checkpoint-step-{step}", daemon=True)
            self._thread.start()
        else:
            with _quiet_single_process():
                dcp.save(state, checkpoint_id=partial, process_group=self.group, no_dist=not _distributed())
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
        _agree(error, self.group)  # (a barrier: every rank's files, and meta.json, are written)
        names, mine = data_files(partial), {}
        try:
            mine = {n: file_record(os.path.join(partial, n)) for n in shard(names, self.rank, self.world)}
        except OSError as e:
            error = f"cannot read back {partial}: {e}"
        records = {}
        for parts, problem in _all_gather((mine, error), self.group):
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
                prune(self.run_dir, self.keep, self.log)
            except (OSError, CheckpointError) as e:
                error = str(e)
        _agree(error, self.group)

    def wait(self) -> None:
        """Finish the save in flight, if any (collective when one is in flight); re-raise its error."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self._pending = None
        error, self._error = self._error, None
        if error is not None:
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
        found = [p for part in _all_gather(problems, self.group) for p in part]
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
        def read() -> tuple[dict, dict]:
            manifest = read_manifest(path)
            try:
                with open(os.path.join(path, META), encoding="utf-8") as f:
                    return json.load(f), manifest
            except (OSError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{os.path.join(path, META)}: not readable ({e})") from None

        meta, manifest = _collectively(read, self.group)
        self.verify_files(path, manifest)
        if before_load is not None:
            _collectively(lambda: before_load(meta, manifest), self.group)
        if optimizer is not None and "optimizer" not in manifest.get("contents", []):
            raise CheckpointError(f"{path} holds model weights only (no optimizer state), so training cannot continue "
                                  "exactly from it; start from its weights with `moe-dist convert` + ckpt.init_from")
        reader = SafeFileSystemReader(path)
        saved = _collectively(lambda: reader.read_metadata().state_dict_metadata, self.group)
        state = expert_keyed_state_dict(model)
        _collectively(lambda: _check_tensors(path, saved, _global_keys(model, state),
                                             {k for k in saved if not k.startswith((OPTIM, RNG))}, "model"), self.group)
        if optimizer is not None:
            _init_optimizer_state(model, optimizer, saved)
            optim = optimizer_state_dict(model, optimizer)
            _collectively(lambda: _check_optimizer(path, model, saved, _global_keys(model, optim)), self.group)
            state.update(optim)
        rng = {}
        if rng_device is not None:
            rng = {k: v for k, v in rng_state(self.rank, rng_device).items() if k in saved}
            if _rng_prefix(self.rank) + "torch_cpu" not in rng:
                rng = {}
            state.update(rng)
        with _quiet_single_process():
            dcp.load(state, storage_reader=reader, process_group=self.group, no_dist=not _distributed())
        if rng:
            set_rng_state(self.rank, rng_device, rng)
        return meta, manifest


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


def _check_optimizer(path: str, model: nn.Module, saved: dict, wanted: dict[str, tuple]) -> None:
    """Optimizer state: every saved entry belongs to a parameter of the model, expert state is
    there for every global expert, shapes match."""
    params = {fqn for fqn, _ in model.named_parameters()}
    saved_optim = {k for k in saved if k.startswith(OPTIM)}
    strangers = sorted(k for k in saved_optim if _split_optim_key(k)[0] not in params)
    if strangers:
        raise CheckpointError(f"checkpoint {path} has optimizer state for parameters this model does not have: "
                              f"{_fmt_keys(strangers)}")
    _check_tensors(path, saved, wanted, saved_optim, "optimizer")


# ---- the first version's API (model weights) -------------------------------------------------------
def save_checkpoint(model: nn.Module, run_dir: str, step: int, meta: dict, is_main: bool = True,
                    optimizer: Optional[torch.optim.Optimizer] = None) -> str:
    """Collective: every rank calls it. Writes ``<run_dir>/checkpoints/step_<step>`` crash-safely
    (meta.json = ``{"step": step, **meta}``); returns its directory. ``is_main`` is kept for
    callers of the first version: rank 0 of torch.distributed (or the only process) writes the
    shared files."""
    return Checkpointer(run_dir).save(step, model, optimizer, meta=meta)


def load_checkpoint(model: nn.Module, path: str, optimizer: Optional[torch.optim.Optimizer] = None,
                    verify: bool = True) -> dict:
    """Load model weights (and optimizer state) in place, at any layout (collective under
    torch.distributed); returns meta.json. Refuses incomplete, damaged or mismatched checkpoints."""
    meta, _ = Checkpointer(os.path.dirname(os.path.dirname(path)), verify=verify).load(path, model, optimizer)
    return meta


# ---- the trainer's checkpoints -----------------------------------------------------------------------
def _dotted(d: dict, key: str):
    for part in key.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


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

    a, b = flat(saved), flat(current)
    structural, other = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            line = f"model.{key}: checkpoint {a.get(key)!r}, config {b.get(key)!r}"
            (structural if key in STRUCTURAL_KEYS else other).append(line)
    return structural, other


class TrainingCheckpoints:
    """What the trainer saves at a step boundary and how it resumes (``ckpt.*`` and ``resume``).

    Needs from the trainer: cfg, rt, run_dir, model, optimizer, sampler, step, data, log.
    """

    def __init__(self, trainer):
        from ..config.load import config_to_dict

        self.t = trainer
        cfg = trainer.cfg
        self.config = config_to_dict(cfg)
        self.checkpointer = Checkpointer(trainer.run_dir, keep=cfg.ckpt.keep, async_save=cfg.ckpt.async_save,
                                         verify=cfg.ckpt.verify, log=trainer.log)
        self.resumed_from: Optional[str] = None

    # ---- save ------------------------------------------------------------------------------------------
    def meta(self) -> dict:
        from .optim import lr_at

        t, cfg = self.t, self.t.cfg
        return {"sampler": t.sampler.state_dict(), "world_size": t.rt.world_size, "ep": t.rt.groups.ep_size,
                "vocab_size": cfg.model.vocab_size, "tokenizer_sha256": t.data.tokenizer.sha256,
                "lr": lr_at(max(t.step - 1, 0), cfg.train),
                "schedule": {k: getattr(cfg.train, k) for k in ("lr", "min_lr_ratio", "warmup_steps", "steps")},
                "config": self.config, "diagnostics": self._diagnostics_state()}

    def _diagnostics_state(self) -> Optional[dict]:
        """The routing diagnostics' histories and the probe set's last assignments (JSON; gathered
        over the data-parallel ranks, so the first probe evaluation after a resume, in any
        layout, compares with them)."""
        diag = getattr(self.t, "diagnostics", None)
        if diag is None or not hasattr(diag, "state_dict"):
            return None
        return diag.state_dict(self.t.rt.groups.dp if self.t.rt.distributed else None)

    def save(self) -> str:
        t = self.t
        return self.checkpointer.save(t.step, t.model, t.optimizer, meta=self.meta(), config=self.config,
                                      rng_device=t.rt.device)

    def wait(self) -> None:
        self.checkpointer.wait()

    # ---- resume ----------------------------------------------------------------------------------------
    def _resolve(self) -> tuple[Optional[str], list[str], Optional[str]]:
        """(checkpoint to load or None, notes, error) for the ``resume`` setting; rank 0 only."""
        choice, notes = self.t.cfg.resume, []
        if choice == "none":
            return None, notes, None
        if choice == "auto":
            path = latest_checkpoint(self.t.run_dir, log=notes.append)
            if path is None:
                notes.append(f"resume=auto: no complete checkpoint in {os.path.join(self.t.run_dir, 'checkpoints')}; "
                             "starting from step 0")
            return path, notes, None
        if not os.path.isdir(choice):
            return None, notes, (f"resume: {choice!r} is not a directory; allowed: auto, none, a checkpoint directory "
                                 "(<run>/checkpoints/step_NNNNNN) or a run directory (its latest checkpoint)")
        if not os.path.exists(os.path.join(choice, META)) and os.path.isdir(os.path.join(choice, "checkpoints")):
            path = latest_checkpoint(choice, log=notes.append)
            if path is None:
                return None, notes, f"resume: run directory {choice!r} has no complete checkpoint"
            return path, notes, None
        return choice, notes, None

    def _check_compatible(self, path: str, meta: dict, manifest: dict) -> None:
        t = self.t
        saved_model = (meta.get("config") or {}).get("model")
        if saved_model is not None:
            structural, other = model_differences(saved_model, self.config["model"])
            if structural:
                raise CheckpointError(f"checkpoint {path} is of another model, nothing was loaded: "
                                      + "; ".join(structural))
            if other:
                t.log(f"resume: settings changed since the checkpoint: {'; '.join(other)}")
        if meta.get("tokenizer_sha256") not in (None, t.data.tokenizer.sha256):
            raise CheckpointError(f"checkpoint {path} was trained with another tokenizer (sha256 "
                                  f"{meta['tokenizer_sha256'][:12]}...) than the data settings give now "
                                  f"({t.data.tokenizer.sha256[:12]}...); check the data.* keys")
        try:
            t.sampler.load_state_dict(meta["sampler"])
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path}: cannot continue its data order: {e}") from None

    def resume(self) -> Optional[str]:
        """Collective. Apply ``resume`` (auto | a path | none): restore model, optimizer, step,
        sampler position and RNG states, then tidy the run directory (metrics rows after the
        resumed step, checkpoints of another timeline). Returns the checkpoint loaded, or None."""
        t = self.t
        group = self.checkpointer.group
        decision = self._resolve() if t.is_main else None
        path, notes, error = _broadcast(decision, group)
        for note in notes:
            t.log(note)
        if error:
            from ..config import ConfigError

            raise ConfigError(error)
        if path is not None:
            meta, manifest = self.checkpointer.load(path, t.model, t.optimizer, rng_device=t.rt.device,
                                                    before_load=lambda m, man: self._check_compatible(path, m, man))
            t.step = int(meta["step"])
            diag = getattr(t, "diagnostics", None)
            if meta.get("diagnostics") and diag is not None and hasattr(diag, "load_state_dict"):
                diag.load_state_dict(meta["diagnostics"])
            self.resumed_from = os.path.abspath(path)
            self._report(path, meta, manifest)
        if t.is_main:
            self._tidy(path)
        _barrier(group)
        return path

    def _report(self, path: str, meta: dict, manifest: dict) -> None:
        t, cfg = self.t, self.t.cfg
        saved, now = manifest.get("layout", {}), {"world_size": t.rt.world_size, "ep": t.rt.groups.ep_size}
        t.log(f"resumed from {path} at step {t.step} (saved by {saved.get('world_size')} rank(s), ep="
              f"{saved.get('ep')}, dense={saved.get('dense')}; now {now['world_size']} rank(s), ep={now['ep']}): "
              f"model, optimizer state, sampler position ({meta['sampler']['consumed']} windows), step")
        schedule = meta.get("schedule") or {}
        changed = [f"train.{k}: {schedule[k]} -> {getattr(cfg.train, k)}" for k in schedule
                   if schedule[k] != getattr(cfg.train, k)]
        if changed:
            t.log(f"resume: the learning-rate schedule differs from the checkpoint's ({'; '.join(changed)}); "
                  "it continues on the new schedule")
        w_saved = saved.get("world_size", 0)
        if "rng" not in manifest.get("contents", []):
            t.log("resume: the checkpoint has no RNG states; every rank keeps its fresh state")
        elif w_saved == now["world_size"]:
            t.log("resume: every rank restored the RNG states saved by the rank of the same index")
        else:
            kept = min(w_saved, now["world_size"])
            t.log(f"resume: RNG states restored on ranks 0..{kept - 1} (saved by {w_saved} ranks"
                  + (f"; the states of ranks {kept}..{w_saved - 1} are unused" if w_saved > kept else
                     f"; ranks {kept}..{now['world_size'] - 1} keep their fresh state")
                  + "). The data order and routing noise depend only on (train.seed, step, global token index), "
                    "not on RNG states or the number of ranks, so training continues the same at any layout")

    def _tidy(self, path: Optional[str]) -> None:
        """Rank 0, after a successful resume (or a fresh start): metrics.jsonl keeps the rows up to
        the resumed step; checkpoints of another timeline (newer than the resumed step, or all of
        them on a fresh start / a resume from elsewhere) are moved to checkpoints.superseded-<time>."""
        t = self.t
        metrics = os.path.join(t.run_dir, "metrics.jsonl")
        if path is None and os.path.exists(metrics):
            os.remove(metrics)
        elif path is not None and os.path.exists(metrics):
            with open(metrics, encoding="utf-8") as f:
                rows = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= t.step]
            with open(metrics + ".tmp", "w", encoding="utf-8") as f:
                f.writelines(rows)
            os.replace(metrics + ".tmp", metrics)
        own_root = os.path.realpath(os.path.join(t.run_dir, "checkpoints"))
        inside = path is not None and os.path.realpath(os.path.dirname(os.path.normpath(path))) == own_root
        limit = t.step if inside else -1
        complete, incomplete = scan(t.run_dir)
        stale = [p for step, p in complete if step > limit]
        for step, p, _why in incomplete:
            if step > limit and p.endswith(".partial"):
                shutil.rmtree(p, ignore_errors=True)
        if stale:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
            aside = os.path.join(t.run_dir, f"checkpoints.superseded-{stamp}")
            os.makedirs(aside, exist_ok=True)
            for p in stale:
                os.rename(p, os.path.join(aside, os.path.basename(p)))
            t.log(f"checkpoint: moved {len(stale)} checkpoint(s) of an earlier run ({', '.join(os.path.basename(p) for p in stale)}) "
                  f"to {aside}, so that resume=auto never mixes two runs")
