"""Crash-safe checkpoint directories: a partial directory, a manifest, an atomic rename.

    <run>/checkpoints/
        step_000100/           complete: DCP files, meta.json and COMPLETE (the manifest, written last)
        step_000110.partial/   being written, or left behind by a crash: never loaded

A save writes everything into ``step_N.partial``, then ``COMPLETE``: a JSON manifest with the
step, world size, parallel layout, config hash and every file's size and SHA-256, and only
then renames the directory to ``step_N`` (atomic on POSIX file systems; the directory
entries are fsynced). Readers consider only ``step_N`` directories whose ``COMPLETE`` parses,
and check sizes and checksums before anything is read from the files, so a truncated or
bit-flipped file is refused by name.

A checkpoint is data, never code: tensors (the DCP ``.distcp`` files), DCP's ``.metadata`` and
JSON (``meta.json``, the ``COMPLETE`` manifest), all read through
:class:`moe_dist.safe_dcp.SafeFileSystemReader`, which unpickles nothing beyond DCP's metadata
classes and weights-only tensor records.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from typing import Callable, Iterable, Optional

from ...errors import CheckpointError, DamagedCheckpoint, UnsafeCheckpoint  # noqa: F401 - re-exported
from ...safe_dcp import SafeFileSystemReader  # noqa: F401 - the reader of every checkpoint, re-exported
from .schema import MANIFEST_FIELDS, META_FIELDS, check_meta, mismatch

MARKER = "COMPLETE"
META = "meta.json"
PARTIAL = ".partial"
FORMAT = "moe_dist.checkpoint"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL_DIR = re.compile(r"^step_(\d+)\.partial$")
_CHUNK = 8 << 20


class IncompleteCheckpoint(CheckpointError, FileNotFoundError):
    """The directory has no (valid) completion marker: a save never finished there."""


LEFTOVER = re.compile(r"^step_\d+(\.partial|\.partial\.deleting-.*|\.deleting-.*|\.superseded-\d+)$")
DAMAGED_SUFFIX = ".damaged"


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step_{step:06d}")


def partial_dir(run_dir: str, step: int) -> str:
    return step_dir(run_dir, step) + PARTIAL


# ---- files and checksums ----------------------------------------------------------------------
def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def file_record(path: str) -> dict:
    return {"bytes": os.path.getsize(path), "sha256": sha256_file(path)}


def data_files(directory: str) -> list[str]:
    """Every file of a checkpoint directory except the marker, sorted (the manifest's list)."""
    return sorted(n for n in os.listdir(directory) if n != MARKER and os.path.isfile(os.path.join(directory, n)))


def shard(names: list[str], rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` hashes (round robin over the sorted list)."""
    return names[rank::world]


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every file system lets a directory be opened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_durably(path: str, obj: dict) -> None:
    """Write ``path`` through a temporary file in the same directory, fsync, rename."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


# ---- the manifest -----------------------------------------------------------------------------
def read_manifest(path: str) -> dict:
    """The manifest of a complete checkpoint; :class:`IncompleteCheckpoint` if there is none."""
    marker = os.path.join(path, MARKER)
    if not os.path.isdir(path):
        raise IncompleteCheckpoint(f"{path}: no such checkpoint directory")
    if not os.path.exists(marker):
        raise IncompleteCheckpoint(f"{path} is not a complete checkpoint (no {MARKER} marker: the save that wrote it "
                                   "did not finish)")
    try:
        with open(marker, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IncompleteCheckpoint(f"{path} is not a complete checkpoint: its {MARKER} marker is not a readable "
                                   f"manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise IncompleteCheckpoint(f"{path} is not a complete checkpoint: its {MARKER} marker is not a "
                                   f"{FORMAT} manifest (written by an older version?)")
    problem = mismatch(manifest, MANIFEST_FIELDS)
    if problem is not None:
        raise IncompleteCheckpoint(f"{path} is not a complete checkpoint: {marker}: {problem}")
    if manifest.get("version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {manifest['version']} is newer than this "
                              f"moe_dist reads ({FORMAT_VERSION}); upgrade moe_dist")
    return manifest


def read_meta(path: str) -> dict:
    """A checkpoint's ``meta.json``: :class:`DamagedCheckpoint` if it is not a JSON object, a
    :class:`CheckpointError` naming the field if a field the code reads has another type
    (:data:`.schema.META_FIELDS`)."""
    full = os.path.join(path, META)
    try:
        with open(full, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:  # ValueError: not JSON, not UTF-8
        raise DamagedCheckpoint(f"{full}: not readable ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise DamagedCheckpoint(f"{full}: holds a JSON {type(meta).__name__}, not an object")
    check_meta(meta, full, META_FIELDS)
    return meta


def check_files(path: str, manifest: dict, names: Iterable[str], checksums: bool = True) -> list[str]:
    """Problems with the listed files of ``path`` (a missing file, a wrong size, a wrong
    SHA-256), one readable line each naming the file; empty if they are intact."""
    problems = []
    for name in names:
        rec = manifest["files"][name]
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            problems.append(f"{full}: missing (the manifest lists it with {rec['bytes']} bytes)")
            continue
        size = os.path.getsize(full)
        if size != rec["bytes"]:
            problems.append(f"{full}: {size} bytes, the manifest says {rec['bytes']} (truncated or overwritten)")
        elif checksums and sha256_file(full) != rec["sha256"]:
            problems.append(f"{full}: SHA-256 differs from the manifest (the file is corrupted)")
    return problems


def corrupted_error(path: str, problems: list[str]) -> CheckpointError:
    return DamagedCheckpoint(f"checkpoint {path} is damaged and was not loaded (nothing was changed): "
                           + "; ".join(problems))


# ---- publishing, scanning, pruning ----------------------------------------------------------------
def _remove_tree(path: str) -> None:
    """Rename first (so a half-deleted directory never looks like a checkpoint), then delete."""
    if not os.path.exists(path):
        return
    doomed = f"{path}.deleting-{os.getpid()}-{time.monotonic_ns()}"
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def start_partial(run_dir: str, step: int) -> str:
    """A fresh, empty ``step_N.partial`` (a leftover of a crashed save of the same step is removed)."""
    path = partial_dir(run_dir, step)
    _remove_tree(path)
    os.makedirs(path)
    return path


def publish(partial: str, final: str) -> None:
    """Make a finished partial directory (marker inside) visible under its final name.

    An existing directory of that name (a checkpoint of an earlier attempt at the same step) is
    moved aside first and deleted after the rename."""
    _fsync_dir(partial)
    aside = None
    if os.path.exists(final):
        aside = f"{final}.superseded-{time.monotonic_ns()}"
        os.rename(final, aside)
    os.rename(partial, final)
    _fsync_dir(os.path.dirname(final))
    if aside:
        shutil.rmtree(aside, ignore_errors=True)


def scan(run_dir: str) -> tuple[list[tuple[int, str]], list[tuple[int, str, str]]]:
    """``(complete, incomplete)`` checkpoints under ``run_dir/checkpoints``, sorted by step:
    ``(step, path)`` and ``(step, path, why it is not loadable)``."""
    root = os.path.join(run_dir, "checkpoints")
    complete, incomplete = [], []
    if not os.path.isdir(root):
        return complete, incomplete
    for name in os.listdir(root):
        path = os.path.join(root, name)
        m = _STEP_DIR.match(name)
        if m:
            try:
                read_manifest(path)
                complete.append((int(m.group(1)), path))
            except CheckpointError as e:
                incomplete.append((int(m.group(1)), path, str(e)))
            continue
        m = _PARTIAL_DIR.match(name)
        if m:
            incomplete.append((int(m.group(1)), path, "a save that did not finish (no completion marker, never renamed)"))
    return sorted(complete), sorted(incomplete)


def remove_leftovers(run_dir: str) -> list[tuple[str, int]]:
    """Delete what unfinished saves and deletions left under ``run_dir/checkpoints`` (``.partial``
    directories, ``.deleting-*`` and ``.superseded-*`` copies, ``*.tmp`` files): none is ever loaded,
    and on a full disk they hold the space a resumed run needs. Call only while no save runs (the
    run-directory lock). Returns ``(path, bytes freed)``."""
    root = os.path.join(run_dir, "checkpoints")
    removed = []
    candidates = [os.path.join(root, n) for n in (os.listdir(root) if os.path.isdir(root) else ()) if LEFTOVER.match(n)]
    candidates += [os.path.join(run_dir, n) for n in (os.listdir(run_dir) if os.path.isdir(run_dir) else ())
                   if n.endswith(".tmp")]
    for path in sorted(candidates):
        size = _tree_bytes(path)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.remove(path)
            except OSError:
                continue
        removed.append((path, size))
    return removed


def _tree_bytes(path: str) -> int:
    if not os.path.isdir(path):
        return os.path.getsize(path) if os.path.exists(path) else 0
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files
               if os.path.exists(os.path.join(d, f)))


def set_aside(path: str, suffix: str = DAMAGED_SUFFIX) -> str:
    """Rename a damaged checkpoint to ``step_N.damaged`` (or ``step_N<suffix>``; ``-2``, ... appended
    if taken): never deleted, never loaded, never pruned. Returns its new path."""
    target, n = path + suffix, 1
    while os.path.exists(target):
        n += 1
        target = f"{path}{suffix}-{n}"
    os.rename(path, target)
    return target


def latest_checkpoint(run_dir: str, log: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """The complete checkpoint with the highest step, or None. ``log`` is told about every
    incomplete checkpoint of a higher step that was skipped."""
    complete, incomplete = scan(run_dir)
    best = complete[-1] if complete else None
    if log is not None:
        for step, path, why in incomplete:
            if best is None or step >= best[0]:
                log(f"checkpoint: skipped {path}: {why}")
    return best[1] if best else None


def prune(run_dir: str, keep: int, log: Callable[[str], None] = lambda _m: None) -> list[str]:
    """Keep the ``keep`` newest complete checkpoints (0 = all); also drop unfinished partial
    directories older than the newest complete one. Returns the removed paths."""
    complete, incomplete = scan(run_dir)
    removed = []
    if keep > 0:
        for _step, path in complete[:-keep]:
            _remove_tree(path)
            removed.append(path)
    newest = complete[-1][0] if complete else None
    for step, path, _why in incomplete:
        if newest is not None and step < newest and path.endswith(PARTIAL):
            _remove_tree(path)
            removed.append(path)
    if removed:
        log(f"checkpoint: removed {', '.join(os.path.basename(p) for p in removed)} (ckpt.keep={keep})")
    return removed
