"""Where a node keeps in-memory snapshot shards between process generations: its holder.

Elastic torchrun restarts the worker processes after a lost node, so a snapshot kept in a
worker's own memory would die with it. The holder is a directory of host memory that outlives
the workers on a node that stays up: ``/dev/shm/moe_dist-<uid>/<run key>/<node>/`` (tmpfs;
``MOE_DIST_SNAPSHOT_ROOT`` names another root). One entry per (step, shard):

    step_000022.shard_00003/   data.raw  index.json  meta.json  COMPLETE

``data.raw`` and ``index.json`` being one rank's state dict in the raw form of :mod:`.raw_shard`
(its tensor blocks with their global shapes and offsets), so the shards of every rank convert
into one DCP checkpoint directory that :class:`~.checkpointer.Checkpointer` loads (and reshards)
like one on disk (:func:`merge`). An entry is written under a dot-name and renamed when complete
(its ``COMPLETE`` marker last): a torn entry is never listed. The marker carries the run id, the
config fingerprint, the step, the shard's rank, the world it was saved in and every file's size.
Each shard's two generations are two entries reused in turn (:class:`Slots`): the older one is
renamed back to a dot-name and its marker removed before its data file is overwritten.

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
from .raw_shard import DATA, INDEX, Region, to_dcp

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
    def staging(self, step: int, rank: int, tag: str = "") -> str:
        """A fresh dot-named directory to write an entry into (made empty)."""
        tmp = self.staging_name(step, rank, tag)
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp, 0o700)
        return tmp

    def staging_name(self, step: int, rank: int, tag: str = "") -> str:
        return os.path.join(self.ensure(), f".{entry_name(step, rank)}.tmp-{os.getpid()}{tag}")

    def publish(self, tmp: str, step: int, rank: int, marker: dict) -> str:
        """Write the marker (the files' sizes, then ``marker``) into ``tmp`` and rename it into place."""
        files = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp)) if n != MARKER}
        write_json_durably(os.path.join(tmp, MARKER), {**marker, "step": step, "rank": rank, "files": files})
        final = os.path.join(self.path, entry_name(step, rank))
        if os.path.lexists(final):
            shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        return final

    def _remove_steps(self, doomed: Callable[[int], bool], shards: Optional[Callable[[int], bool]] = None) -> None:
        for name in os.listdir(self.path) if os.path.isdir(self.path) else []:
            m = re.match(r"^\.?(?:step_(\d+)\.shard_(\d+)|merged_step_(\d+))", name)
            if not m or (shards is not None and (m.group(2) is None or not shards(int(m.group(2))))):
                continue
            if doomed(int(m.group(1) or m.group(3))):
                shutil.rmtree(os.path.join(self.path, name), ignore_errors=True)

    def prune(self, newest: int, shards: Optional[Callable[[int], bool]] = None) -> None:
        """Remove every entry (unfinished, merged) of a step before ``newest - 1``: two generations stay.
        ``shards``: only entries of the shard ranks it takes (those the caller alone writes on this node)."""
        self._remove_steps(lambda step: step < newest - 1, shards)

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
def merge(holder: Holder, step: int, world: int, manifest: dict, checksums: bool = False) -> str:
    """The shards ``0..world-1`` of ``step`` (all in ``holder``) as one checkpoint directory that
    :class:`~.checkpointer.Checkpointer` loads: each shard's tensor blocks (each block once) in a DCP
    data file, their DCP metadata, shard 0's ``meta.json`` and a manifest (the files' sizes; their
    SHA-256 only with ``checksums``, for a loader that verifies them: the files were made just now
    from entries whose sizes were checked)."""
    from torch.distributed.checkpoint.metadata import Metadata

    out = holder.merged(step)
    tmp = out + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    os.mkdir(tmp, 0o700)
    sd_md, storage, planner = to_dcp([(rank, holder.entry(step, rank)) for rank in range(world)], tmp)
    with open(os.path.join(tmp, ".metadata"), "wb") as f:
        pickle.dump(Metadata(state_dict_metadata=sd_md, planner_data=planner, storage_data=storage), f)
    shutil.copyfile(os.path.join(holder.entry(step, 0), META), os.path.join(tmp, META))
    records = {n: file_record(os.path.join(tmp, n), checksum=checksums) for n in sorted(os.listdir(tmp))}
    write_json_durably(os.path.join(tmp, MARKER), {**manifest, "files": records, "tensors": len(sd_md)})
    os.rename(tmp, out)
    return out


# ---- two generations of one shard, reused step after step ---------------------------------------------------
class Slots:
    """Both generations of shard ``shard``'s entry in ``holder``, written by this process only: two
    data files of ``nbytes`` allocated once (:class:`~.raw_shard.Region`, mapped for good), each in
    turn renamed to a dot-name (its marker removed: no longer complete), filled, then published."""

    def __init__(self, holder: Holder, shard: int, nbytes: int, first_step: int):
        self.holder, self.shard, self.nbytes = holder, shard, nbytes
        self.gens: list[list] = []  # [region, its directory now, the index.json text written there]
        self.turn = 0  # the generation written next: the older one
        try:
            for g in range(2):
                tmp = holder.staging(first_step, shard, f"-g{g}")  # (named as a step that prune keeps)
                self.gens.append([Region(os.path.join(tmp, DATA), nbytes), tmp, None])
        except BaseException:
            self.release()
            raise

    def stage(self, step: int, index_text: Optional[str]) -> tuple[Region, str]:
        """The older generation, under a dot-name for ``step``, with ``index_text`` as its index (None: the
        caller writes it): (region, dir)."""
        gen = self.gens[self.turn]
        tmp = self.holder.staging_name(step, self.shard)
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        os.rename(gen[1], tmp)  # from now on not complete: never listed
        gen[1] = tmp
        try:
            os.unlink(os.path.join(tmp, MARKER))
        except FileNotFoundError:
            pass
        if index_text is not None:
            self.write_index(index_text)
        return gen[0], tmp

    def write_index(self, index_text: str) -> None:
        """The staged generation's ``index.json`` (written only when it differs from what it holds)."""
        gen = self.gens[self.turn]
        if gen[2] != index_text:
            with open(os.path.join(gen[1], INDEX), "w", encoding="utf-8") as f:
                f.write(index_text)
            gen[2] = index_text

    def publish(self, step: int, marker: dict) -> str:
        """The staged generation renamed into place as the complete entry of ``step``; the other is next."""
        gen = self.gens[self.turn]
        gen[1] = self.holder.publish(gen[1], step, self.shard, marker)
        self.turn ^= 1
        return gen[1]

    def release(self) -> None:
        """Both generations removed (their memory freed once unmapped)."""
        for gen in self.gens:
            shutil.rmtree(gen[1], ignore_errors=True)
        self.gens = []
