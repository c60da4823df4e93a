"""Hand-made hostile checkpoints for the security tests (a test helper, not a test).

Each function takes a complete moe_dist checkpoint directory and plants a pickled object whose
unpickling creates ``marker`` (``open(marker, "w")``: the proof that loading ran code), the way
an attacker would: the DCP ``.metadata`` is rewritten with plain pickle, bytes are appended to a
data file, and the ``COMPLETE`` manifest's sizes and SHA-256 sums are recomputed so that every
integrity check passes.
"""
from __future__ import annotations

import io
import json
import os
import pickle

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from moe_dist.train.checkpoint.files import MARKER, file_record


class Payload:
    """Unpickles to ``open(marker, "w")``: loading it creates the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def payload_bytes(marker: str) -> bytes:
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)  # how DCP writes a bytes entry (and how it reads it back: torch.load)
    return buf.getvalue()


def reseal(ckpt: str) -> None:
    """Recompute the manifest's file list, sizes and checksums (what a forger does)."""
    path = os.path.join(ckpt, MARKER)
    if not os.path.exists(path):  # not a moe_dist checkpoint (Megatron's torch_dist): nothing to reseal
        return
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    manifest["files"] = {n: file_record(os.path.join(ckpt, n)) for n in sorted(os.listdir(ckpt))
                         if n != MARKER and os.path.isfile(os.path.join(ckpt, n))}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(manifest, f)


def read_metadata(ckpt: str):
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        return pickle.load(f)  # the test's own, trusted file


def write_metadata(ckpt: str, metadata) -> None:
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


def _append(ckpt: str, data: bytes) -> tuple[str, int]:
    """Append ``data`` to the checkpoint's first data file; returns (file name, offset)."""
    name = sorted(n for n in os.listdir(ckpt) if n.endswith(".distcp"))[0]
    path = os.path.join(ckpt, name)
    offset = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(data)
    return name, offset


def _point(metadata, index: MetadataIndex, name: str, offset: int, length: int) -> None:
    """Replace every storage record of the entry by one, at ``index``, pointing at the planted bytes."""
    for old in [i for i in metadata.storage_data if i.fqn == index.fqn]:
        del metadata.storage_data[old]
    metadata.storage_data[index] = _StorageInfo(relative_path=name, offset=offset, length=length)


def plant_bytes_entry(ckpt: str, key: str, marker: str) -> None:
    """Declare ``key`` a bytes entry (DCP unpickles those with weights_only=False) holding the payload."""
    metadata = read_metadata(ckpt)
    assert key in metadata.state_dict_metadata, f"{key} is not in the checkpoint"
    data = payload_bytes(marker)
    name, offset = _append(ckpt, data)
    metadata.state_dict_metadata[key] = BytesStorageMetadata()
    _point(metadata, MetadataIndex(key), name, offset, len(data))
    write_metadata(ckpt, metadata)
    reseal(ckpt)


def plant_tensor_record(ckpt: str, key: str, marker: str) -> None:
    """Keep ``key`` declared as a tensor but make its stored record the payload's pickle."""
    metadata = read_metadata(ckpt)
    md = metadata.state_dict_metadata[key]
    data = payload_bytes(marker)
    name, offset = _append(ckpt, data)
    md.chunks = md.chunks[:1]
    md.chunks[0].offsets, md.chunks[0].sizes = torch.Size([0] * len(md.size)), md.size
    _point(metadata, MetadataIndex(key, md.chunks[0].offsets, 0), name, offset, len(data))
    write_metadata(ckpt, metadata)
    reseal(ckpt)


def plant_metadata(ckpt: str, marker: str) -> None:
    """The ``.metadata`` file itself is the payload."""
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(Payload(marker), f)
    reseal(ckpt)


def plant_file(ckpt: str, name: str, marker: str) -> None:
    """A JSON file of the checkpoint (``meta.json`` or the manifest) replaced by the payload's pickle."""
    with open(os.path.join(ckpt, name), "wb") as f:
        pickle.dump(Payload(marker), f)
    if name != MARKER:
        reseal(ckpt)


def entry_keys(ckpt: str) -> dict[str, str]:
    """One key of each kind a training checkpoint holds: an expert weight, a dense weight, the router's
    state, an optimizer state entry, an RNG state."""
    keys = sorted(read_metadata(ckpt).state_dict_metadata)
    pick = {
        "expert weight": next(k for k in keys if ".experts." in k and not k.startswith("optim.")),
        "dense weight": next(k for k in keys if k.endswith("norm.weight") and not k.startswith("optim.")),
        "router state": next(k for k in keys if ".router." in k and not k.startswith("optim.")),
        "optimizer state": next(k for k in keys if k.startswith("optim.") and k.endswith("exp_avg_sq")),
        "rng state": next(k for k in keys if k.startswith("rng.") and k.endswith("torch_cpu")),
    }
    return pick
