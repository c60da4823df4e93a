"""The raw form of an in-memory snapshot shard: one rank's state dict as one preallocated file of
host memory, the tensors at fixed byte offsets, with a small JSON index; converted to a DCP
checkpoint directory only when a resume reads it.

Why raw: taking a snapshot every step must cost the training little. A DCP save serialises
every tensor (``torch.save``), allocates fresh buffers and writes new files each time; here
each tensor is one ``copy_`` into a view of a file in ``/dev/shm`` that was allocated once
(``posix_fallocate``, so a full file system says ENOSPC at that moment instead of a SIGBUS at a
later page fault) and stays mapped in the process for every later step. The same buffer is what
the buddy copy sends and receives, so nothing is pickled or copied again on the way.

The index (``index.json``) lists per tensor the entry name, dtype, this rank's block (its shape,
its offsets in the global tensor, the global size) and its byte offset in ``data.raw``; it is
computed with DCP's own save planner, so the blocks are exactly those a DCP save would write.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch

from .files import CheckpointError

DATA, INDEX = "data.raw", "index.json"
ALIGN = 64  # byte alignment of every tensor in the data file (any dtype's view is aligned)
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}


@dataclass(frozen=True)
class Item:
    """One tensor block of a shard: ``fqn``'s block of ``shape`` at ``offsets`` in a tensor of ``size``."""
    fqn: str
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    size: tuple[int, ...]
    requires_grad: bool
    at: int  # byte offset in the data file
    nbytes: int


def local(t: torch.Tensor) -> torch.Tensor:
    """The block of ``t`` this rank holds (a DTensor's local tensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def signature(state: dict) -> tuple:
    """What decides the layout (names, local shapes, dtypes): cheap enough to compare at every snapshot."""
    return tuple((k, tuple(local(v).shape), v.dtype, type(v).__name__) for k, v in state.items())


def layout(state: dict) -> tuple[list[Item], int]:
    """(the items of ``state``, the data file's size), from DCP's save planner (its blocks and offsets)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    from .collective import around_dcp

    planner = DefaultSavePlanner()
    with around_dcp():
        planner.set_up_planner(state, storage_meta=None, is_coordinator=True)
        plan = planner.create_local_plan()
    items, at, seen = [], 0, set()
    for w in plan.items:
        fqn = w.index.fqn
        if w.type == WriteItemType.BYTE_IO or w.tensor_data is None or fqn in seen:
            raise CheckpointError(f"state entry {fqn!r} is not one tensor block (a snapshot holds only tensors, "
                                  "one block per rank)")
        seen.add(fqn)
        t = local(state[fqn])
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES or tuple(t.shape) != tuple(w.tensor_data.chunk.sizes):
            raise CheckpointError(f"state entry {fqn!r} ({dtype}, {tuple(t.shape)}) cannot be kept raw")
        nbytes = t.numel() * t.element_size()
        items.append(Item(fqn, dtype, tuple(t.shape), tuple(w.tensor_data.chunk.offsets),
                          tuple(w.tensor_data.size), bool(w.tensor_data.properties.requires_grad), at, nbytes))
        at += -(-nbytes // ALIGN) * ALIGN
    return items, max(at, ALIGN)


def index_json(items: list[Item], nbytes: int) -> str:
    return json.dumps({"bytes": nbytes, "items": [asdict(i) for i in items]})


def read_index(entry: str) -> tuple[list[Item], int]:
    """The items of an entry's ``index.json`` (checked: known dtypes, blocks inside the data file)."""
    from ...safe_io import read_json

    doc = read_json(os.path.join(entry, INDEX), 64 << 20)
    nbytes = int(doc["bytes"])
    items = []
    for d in doc["items"]:
        item = Item(str(d["fqn"]), str(d["dtype"]), tuple(int(x) for x in d["shape"]),
                    tuple(int(x) for x in d["offsets"]), tuple(int(x) for x in d["size"]), bool(d["requires_grad"]),
                    int(d["at"]), int(d["nbytes"]))
        dtype = _DTYPES.get(item.dtype)
        numel = 1
        for s in item.shape:
            numel *= s
        if (dtype is None or item.at % ALIGN or item.at < 0 or item.at + item.nbytes > nbytes
                or numel * dtype.itemsize != item.nbytes or len(item.offsets) != len(item.shape)
                or len(item.size) != len(item.shape)
                or any(o < 0 or o + s > g for o, s, g in zip(item.offsets, item.shape, item.size))):
            raise CheckpointError(f"{entry}: {INDEX} describes {item.fqn!r} as a block outside its data file or tensor")
        items.append(item)
    return items, nbytes


class Region:
    """A file of ``nbytes`` in host memory (tmpfs), allocated at once and mapped into this process as
    a byte tensor (``buf``); views of it are the tensors of a shard."""

    def __init__(self, path: str, nbytes: int):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC here, not a SIGBUS at the first write
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.nbytes = nbytes
        self.buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)

    def view(self, item: Item) -> torch.Tensor:
        return block(self.buf, item)


def block(buf: torch.Tensor, item: Item) -> torch.Tensor:
    """``item``'s tensor block as a view of the data file's bytes ``buf``."""
    return buf[item.at:item.at + item.nbytes].view(_DTYPES[item.dtype]).view(item.shape)


def copy_in(region: Region, items: list[Item], state: dict) -> None:
    """Copy every tensor block of ``state`` into its place in ``region`` (the training thread, at a step boundary)."""
    with torch.no_grad():
        for item in items:
            region.view(item).copy_(local(state[item.fqn]))


def mapped(entry: str, nbytes: int) -> torch.Tensor:
    """An entry's data file as a read-only byte tensor (shared mapping: no copy)."""
    path = os.path.join(entry, DATA)
    if os.path.getsize(path) != nbytes:
        raise CheckpointError(f"{path}: {os.path.getsize(path)} bytes, its index says {nbytes}")
    return torch.from_file(path, shared=False, size=nbytes, dtype=torch.uint8)


def to_dcp(entries: list[tuple[int, str]], out: str) -> tuple[dict, dict, dict]:
    """Write the tensor blocks of ``entries`` ((shard rank, entry directory), each block once: a replica's
    copy is skipped) into DCP data files ``shard_<rank>.distcp`` in ``out``; returns the DCP metadata
    tables (state_dict_metadata, storage_data, planner_data) for them."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)

    sd_md, storage, planner, stored = {}, {}, {}, set()
    for rank, entry in entries:
        items, nbytes = read_index(entry)
        buf = mapped(entry, nbytes)
        name = f"shard_{rank:05d}.distcp"
        with open(os.path.join(out, name), "wb") as f:
            for item in items:
                key = (item.fqn, item.offsets)
                if key in stored:
                    continue
                stored.add(key)
                start = f.tell()
                torch.save(block(buf, item).clone(), f)
                storage[MetadataIndex(item.fqn, torch.Size(item.offsets))] = _StorageInfo(name, start, f.tell() - start)
                chunk = ChunkStorageMetadata(offsets=torch.Size(item.offsets), sizes=torch.Size(item.shape))
                if item.fqn in sd_md:
                    sd_md[item.fqn].chunks.append(chunk)
                else:
                    props = TensorProperties(dtype=_DTYPES[item.dtype], requires_grad=item.requires_grad)
                    sd_md[item.fqn] = TensorStorageMetadata(properties=props, size=torch.Size(item.size), chunks=[chunk])
                    planner[item.fqn] = (item.fqn,)
        del buf
    return sd_md, storage, planner
