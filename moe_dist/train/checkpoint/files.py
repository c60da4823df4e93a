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
import os
import re
import shutil
import stat
import time
from typing import Callable, Iterable, Optional

from ...errors import CheckpointError, DamagedCheckpoint, UnsafeCheckpoint  # noqa: F401 - re-exported
from ...safe_dcp import SafeFileSystemReader  # noqa: F401 - the reader of every checkpoint, re-exported
from ...safe_io import (MIB, UnreadableFile, UnsafePath, fsync_directory, kind_of, open_regular, read_json, refuse_link,
                        write_json_atomically)
from .schema import MANIFEST_FIELDS, META_FIELDS, check_meta, mismatch

MARKER = "COMPLETE"
META = "meta.json"
PARTIAL = ".partial"
FORMAT = "moe_dist.checkpoint"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL_DIR = re.compile(r"^step_(\d+)\.partial$")
_CHUNK = 8 << 20
# a manifest lists every file of a checkpoint (a few per rank); meta.json holds the config, the sampler
# position and the routing diagnostics' histories
MANIFEST_LIMIT, META_LIMIT = 64 * MIB, 256 * MIB
_FILE_NAME = re.compile(r"^(?!\.\.?$)[A-Za-z0-9_.\-]+$")  # a file of the directory itself: no "/", not "." or ".."


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
    with open_regular(path) as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def file_record(path: str, checksum: bool = True) -> dict:
    """A manifest's record of ``path``: its size and SHA-256 (``""`` when not computed: ``checksum=False``)."""
    return {"bytes": os.path.getsize(path), "sha256": sha256_file(path) if checksum else ""}


def data_files(directory: str) -> list[str]:
    """Every file of a checkpoint directory except the marker, sorted (the manifest's list)."""
    return sorted(n for n in os.listdir(directory) if n != MARKER and os.path.isfile(os.path.join(directory, n)))


def shard(names: list[str], rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` hashes (round robin over the sorted list)."""
    return names[rank::world]


def write_json_durably(path: str, obj: dict) -> None:
    """Write ``path`` through a fresh temporary file in the same directory, fsync, rename (a link at
    ``path`` is replaced, never followed)."""
    write_json_atomically(path, obj, durable=True, sort_keys=True)


# ---- the manifest -----------------------------------------------------------------------------
def read_manifest(path: str) -> dict:
    """The manifest of a complete checkpoint; :class:`IncompleteCheckpoint` if there is none."""
    marker = os.path.join(path, MARKER)
    if not os.path.isdir(path):
        raise IncompleteCheckpoint(f"{path}: no such checkpoint directory")
    if not os.path.lexists(marker):
        raise IncompleteCheckpoint(f"{path} is not a complete checkpoint (no {MARKER} marker: the save that wrote it "
                                   "did not finish)")
    try:
        manifest = read_json(marker, MANIFEST_LIMIT)
    except UnreadableFile as e:
        raise IncompleteCheckpoint(f"{path} is not a complete checkpoint: its {MARKER} marker is not a readable "
                                   f"manifest ({e.why})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise IncompleteCheckpoint(f"{path} is not a complete checkpoint: its {MARKER} marker is not a "
                                   f"{FORMAT} manifest (written by an older version?)")
    problem = mismatch(manifest, MANIFEST_FIELDS)
    if problem is not None:
        raise IncompleteCheckpoint(f"{path} is not a complete checkpoint: {marker}: {problem}")
    names = [n for n in manifest["files"] if not _FILE_NAME.match(n) or n == MARKER]
    if names:
        raise IncompleteCheckpoint(f"{path} is not a complete checkpoint: {marker} lists {names[0]!r}, which is not a "
                                   "plain file name of the checkpoint directory (a listed file must stay inside it)")
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
        meta = read_json(full, META_LIMIT)
    except UnreadableFile as e:
        raise DamagedCheckpoint(f"{full}: not readable ({e.why})") from None
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
        if not os.path.lexists(full):
            problems.append(f"{full}: missing (the manifest lists it with {rec['bytes']} bytes)")
            continue
        mode = os.lstat(full).st_mode
        if not stat.S_ISREG(mode):
            problems.append(f"{full}: {kind_of(mode)}, where the manifest lists a regular file of the checkpoint")
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
def _remove_tree(path: str) -> bool:
    """Rename first (so a half-deleted directory never looks like a checkpoint), then delete (a link:
    the link itself); whether nothing is left (a remainder keeps its ``.deleting-`` name, which the
    next start removes)."""
    if not os.path.lexists(path):
        return True
    doomed = f"{path}.deleting-{os.getpid()}-{time.monotonic_ns()}"
    os.rename(path, doomed)
    return _delete(doomed)


def start_partial(run_dir: str, step: int) -> str:
    """A fresh, empty ``step_N.partial`` (a leftover of a crashed save of the same step is removed)."""
    checkpoints_root(run_dir)
    path = partial_dir(run_dir, step)
    _remove_tree(path)
    os.makedirs(path)
    return path


def publish(partial: str, final: str) -> None:
    """Make a finished partial directory (marker inside) visible under its final name.

    An existing directory of that name (a checkpoint of an earlier attempt at the same step) is
    moved aside first and deleted after the rename."""
    fsync_directory(partial)
    aside = None
    if os.path.exists(final):
        aside = f"{final}.superseded-{time.monotonic_ns()}"
        os.rename(final, aside)
    os.rename(partial, final)
    fsync_directory(os.path.dirname(final))
    if aside:
        shutil.rmtree(aside, ignore_errors=True)


def checkpoints_root(run_dir: str) -> str:
    """``run_dir/checkpoints``, which must not be a link: what is pruned, set aside or removed there
    must belong to this run (:class:`~moe_dist.safe_io.UnsafePath` otherwise)."""
    root = os.path.join(run_dir, "checkpoints")
    try:
        refuse_link(root, "the run's checkpoint directory")
    except UnsafePath as e:
        raise CheckpointError(str(e)) from None
    return root


def scan(run_dir: str) -> tuple[list[tuple[int, str]], list[tuple[int, str, str]]]:
    """``(complete, incomplete)`` checkpoints under ``run_dir/checkpoints``, sorted by step:
    ``(step, path)`` and ``(step, path, why it is not loadable)``. A link named like a checkpoint
    is never one."""
    root = checkpoints_root(run_dir)
    complete, incomplete = [], []
    if not os.path.isdir(root):
        return complete, incomplete
    for name in os.listdir(root):
        path = os.path.join(root, name)
        m = _STEP_DIR.match(name) or _PARTIAL_DIR.match(name)
        if m and os.path.islink(path):
            incomplete.append((int(m.group(1)), path, f"a symbolic link to {os.readlink(path)!r}, not a checkpoint "
                               "directory of this run"))
            continue
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
    root = checkpoints_root(run_dir)
    removed = []
    candidates = [os.path.join(root, n) for n in (os.listdir(root) if os.path.isdir(root) else ()) if LEFTOVER.match(n)]
    candidates += [os.path.join(run_dir, n) for n in (os.listdir(run_dir) if os.path.isdir(run_dir) else ())
                   if n.endswith(".tmp")]
    for path in sorted(candidates):
        size = _tree_bytes(path)
        if _delete(path):
            removed.append((path, size))
    return removed


def _delete(path: str) -> bool:
    """Delete a file, a link (the link, never what it points to) or a directory tree (whose links are
    removed, not followed); whether nothing is left."""
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError:
        return not os.path.lexists(path)
    return True


def _tree_bytes(path: str) -> int:
    if os.path.islink(path) or not os.path.lexists(path):
        return 0
    if not os.path.isdir(path):
        return os.lstat(path).st_size
    return sum(os.lstat(os.path.join(d, f)).st_size for d, _, files in os.walk(path) for f in files
               if os.path.lexists(os.path.join(d, f)))


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
    doomed = [path for _step, path in complete[:-keep]] if keep > 0 else []
    newest = complete[-1][0] if complete else None
    doomed += [path for step, path, _why in incomplete
               if newest is not None and step < newest and path.endswith(PARTIAL) and not os.path.islink(path)]
    removed = [path for path in doomed if _remove_tree(path)]
    if removed:
        log(f"checkpoint: removed {', '.join(removed)} (ckpt.keep={keep})")
    if len(removed) < len(doomed):
        log(f"checkpoint: could not remove all of {', '.join(p for p in doomed if p not in removed)}; what is left "
            "carries a .deleting- name and is removed at the next start")
    return removed
