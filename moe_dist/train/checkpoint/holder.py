"""Where a node keeps in-memory snapshot shards between process generations: its holder.

Elastic torchrun restarts the worker processes after a lost node, so a snapshot kept in a
worker's own memory would die with it. The holder is a directory of host memory that outlives
the workers on a node that stays up: ``/dev/shm/moe_dist-<uid>/<run key>/<node>/`` (tmpfs;
``MOE_DIST_SNAPSHOT_ROOT`` names another root). One entry per (step, shard):

    step_000022.shard_00003/   .metadata  __0_0.distcp  meta.json  COMPLETE

the shard being the DCP save (``no_dist``) of one rank's state dict, exactly the dict a disk
checkpoint writes, with global shapes and offsets, so the shards of every rank merge into one
checkpoint directory that :class:`~.checkpointer.Checkpointer` loads (and reshards) like one
on disk (:func:`merge`). An entry is written under a dot-name and renamed when complete (its
``COMPLETE`` marker last): a torn entry is never listed. The marker carries the run id, the
config fingerprint, the step, the shard's rank and the world it was saved in.

Only the user's own directories are used: every level must be a real directory owned by this
user, mode 0700 at the root (a link or another owner is refused).
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional

from ...safe_io import UnreadableFile, read_json
from .files import MARKER, META, CheckpointError, file_record, write_json_durably

ROOT_ENV = "MOE_DIST_SNAPSHOT_ROOT"
_ENTRY = re.compile(r"^step_(\d+)\.shard_(\d+)$")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_HEADER = 16  # bytes of the packed form's header length (decimal, zero-padded)


def root_dir() -> str:
    base = os.environ.get(ROOT_ENV) or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    return os.path.join(base, f"moe_dist-{os.getuid()}")


def _own_dir(path: str, mode: int = 0o700) -> str:
    """``path`` as a directory of this user (made when missing); a link or another owner is refused."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise CheckpointError(f"snapshot holder {path} is not a directory of this user (a link, or another owner's); "
                              "in-memory snapshots are not used")
    return path


def entry_name(step: int, rank: int) -> str:
    return f"step_{step:06d}.shard_{rank:05d}"


@dataclass(frozen=True)
class Shard:
    """A complete entry of a holder: ``rank``'s shard of the state after ``step``, saved in a world of ``world``."""
    step: int
    rank: int
    world: int
    bytes: int


class Holder:
    """One node's holder for one run (``run_key``: a file-name-safe digest of the run id)."""

    def __init__(self, run_key: str, node: str):
        safe_node = re.sub(r"[^A-Za-z0-9_.\-]", "_", node) or "node"
        self.node = node
        self.run_dir = os.path.join(root_dir(), run_key)
        self.path = os.path.join(self.run_dir, safe_node)

    def ensure(self) -> str:
        os.makedirs(os.path.dirname(root_dir()), exist_ok=True)  # /dev/shm, or the root named by MOE_DIST_SNAPSHOT_ROOT
        _own_dir(root_dir())
        _own_dir(self.run_dir)
        return _own_dir(self.path)

    # ---- writing --------------------------------------------------------------------------------------
    def staging(self, step: int, rank: int) -> str:
        """A fresh dot-named directory to write an entry into (made empty)."""
        tmp = os.path.join(self.ensure(), f".{entry_name(step, rank)}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp, 0o700)
        return tmp

    def publish(self, tmp: str, step: int, rank: int, marker: dict) -> str:
        """Write the marker (the files' sizes, then ``marker``) into ``tmp`` and rename it into place."""
        files = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp)) if n != MARKER}
        write_json_durably(os.path.join(tmp, MARKER), {**marker, "step": step, "rank": rank, "files": files})
        final = os.path.join(self.path, entry_name(step, rank))
        if os.path.lexists(final):
            shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        return final

    def _remove_steps(self, doomed: Callable[[int], bool]) -> None:
        for name in os.listdir(self.path) if os.path.isdir(self.path) else []:
            m = re.match(r"^\.?(?:step_(\d+)\.shard_\d+|merged_step_(\d+))", name)
            if m and doomed(int(m.group(1) or m.group(2))):
                shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)

    def prune(self, newest: int) -> None:
        """Remove every entry (unfinished, merged) of a step before ``newest - 1``: two generations stay."""
        self._remove_steps(lambda step: step < newest - 1)

    def remove_after(self, step: int) -> None:
        """Remove every entry of a step after ``step`` (another timeline once the run goes on from ``step``)."""
        self._remove_steps(lambda s: s > step)

    def remove_all(self) -> None:
        """This node's entries of the run; the run's directory and the root once empty."""
        shutil.rmtree(self.path, ignore_errors=True)
        for empty in (self.run_dir, root_dir()):  # each only once nothing else is in it
            try:
                os.rmdir(empty)
            except OSError:
                pass

    # ---- reading --------------------------------------------------------------------------------------
    def merged(self, step: int) -> str:
        """Where :func:`merge` puts the checkpoint directory of ``step``."""
        return os.path.join(self.path, f"merged_step_{step:06d}")

    def entry(self, step: int, rank: int) -> str:
        return os.path.join(self.path, entry_name(step, rank))

    def complete(self, accept: Callable[[dict], Optional[str]]) -> tuple[list[Shard], list[str]]:
        """(the complete entries whose marker ``accept`` takes, refusals): an entry is complete when its
        marker is there, readable, and every file it lists has its size; ``accept(marker)`` returns why
        not (another run id or config) or None."""
        found, refused = [], []
        for name in sorted(os.listdir(self.path)) if os.path.isdir(self.path) else []:
            m = _ENTRY.match(name)
            if not m:
                continue
            full = os.path.join(self.path, name)
            try:
                marker = read_json(os.path.join(full, MARKER), 1 << 20)
                files = marker["files"]
                ok = all(_NAME.match(n) and os.path.getsize(os.path.join(full, n)) == size for n, size in files.items())
                step, rank, world = int(marker["step"]), int(marker["rank"]), int(marker["world"])
            except (OSError, UnreadableFile, KeyError, TypeError, ValueError, AttributeError):
                continue  # torn or foreign: never taken as complete
            if not ok or (step, rank) != (int(m.group(1)), int(m.group(2))) or not 0 <= rank < world:
                continue
            why = accept(marker)
            if why:
                refused.append(f"{full}: {why}")
                continue
            found.append(Shard(step, rank, world, sum(files.values())))
        return found, refused


# ---- the packed form, for the buddy copy and the resume's fetch ----------------------------------------
def pack(entry: str) -> bytes:
    """An entry's files as one byte string: a header (the names and sizes, JSON) and the files in that order."""
    names = sorted(os.listdir(entry))
    blobs = []
    for n in names:
        with open(os.path.join(entry, n), "rb") as f:
            blobs.append(f.read())
    header = json.dumps([[n, len(b)] for n, b in zip(names, blobs)]).encode()
    return f"{len(header):0{_HEADER}d}".encode() + header + b"".join(blobs)


def unpack(data: bytes, holder: Holder, step: int, rank: int) -> str:
    """Write a packed entry into ``holder`` (staged, renamed last); the marker must name ``step`` and ``rank``."""
    size = int(data[:_HEADER])
    listing = json.loads(data[_HEADER:_HEADER + size])
    tmp, at = holder.staging(step, rank), _HEADER + size
    try:
        for name, length in listing:
            if not _NAME.match(name):
                raise CheckpointError(f"a snapshot shard sent for step {step} names the file {name!r}")
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data[at:at + length])
            at += length
        marker = read_json(os.path.join(tmp, MARKER), 1 << 20)
        if (marker.get("step"), marker.get("rank")) != (step, rank) or at != len(data):
            raise CheckpointError(f"a snapshot shard sent as step {step} rank {rank} is another or torn")
        final = holder.entry(step, rank)
        if os.path.lexists(final):
            shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---- merging the shards of one step into a checkpoint directory -------------------------------------------
def merge(holder: Holder, step: int, world: int, manifest: dict) -> str:
    """The shards ``0..world-1`` of ``step`` (all in ``holder``) as one checkpoint directory that
    :class:`~.checkpointer.Checkpointer` loads: the shards' data files linked in under flat names,
    their DCP metadata merged (each tensor's chunks once), shard 0's ``meta.json``, a manifest."""
    from torch.distributed.checkpoint.metadata import Metadata

    from ...safe_dcp import SafeFileSystemReader

    out = holder.merged(step)
    tmp = out + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    os.mkdir(tmp, 0o700)
    sd_md, storage, planner = {}, {}, {}
    chunks_seen: dict[str, set] = {}  # fqn -> the offsets of its chunks taken so far
    stored: set = set()  # (fqn, offsets) of the storage records taken so far
    version = None
    for rank in range(world):
        entry = holder.entry(step, rank)
        md = SafeFileSystemReader(entry).read_metadata()
        version = version or md.version
        renamed = {}
        for name in os.listdir(entry):
            if name.endswith(".distcp"):
                renamed[name] = f"shard_{rank:05d}{name.lstrip('_')}"
                os.link(os.path.join(entry, name), os.path.join(tmp, renamed[name]))
        for index, info in md.storage_data.items():
            key = (index.fqn, tuple(index.offset) if index.offset is not None else None)
            if key in stored:
                continue  # a replica's copy (a replicated tensor, an expert of several edp ranks): once
            if info.relative_path not in renamed:
                raise CheckpointError(f"{entry}: its metadata names {info.relative_path!r}, which it does not hold")
            stored.add(key)
            info.relative_path = renamed[info.relative_path]
            storage[index] = info
        for fqn, tmd in md.state_dict_metadata.items():
            seen = chunks_seen.setdefault(fqn, set())
            if fqn not in sd_md:
                sd_md[fqn] = tmd
                seen.update(tuple(c.offsets) for c in getattr(tmd, "chunks", []))
                continue
            for chunk in getattr(tmd, "chunks", []):
                if tuple(chunk.offsets) not in seen:
                    seen.add(tuple(chunk.offsets))
                    sd_md[fqn].chunks.append(chunk)
        planner.update(md.planner_data or {})
    merged = Metadata(state_dict_metadata=sd_md, planner_data=planner, storage_data=storage)
    if version is not None:
        merged.version = version
    with open(os.path.join(tmp, ".metadata"), "wb") as f:
        pickle.dump(merged, f)
    shutil.copyfile(os.path.join(holder.entry(step, 0), META), os.path.join(tmp, META))
    records = {n: file_record(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))}
    write_json_durably(os.path.join(tmp, MARKER), {**manifest, "files": records, "tensors": len(sd_md)})
    os.rename(tmp, out)
    return out
