"""Reading and writing safetensors checkpoints: one file, or shards with an index.

Layout (the Hugging Face convention, also used for our own upcycled weights):
``model.safetensors``, or ``model-00001-of-00003.safetensors``... with
``model.safetensors.index.json`` = ``{"metadata": {...}, "weight_map": {name: shard file}}``.
Tensors are read lazily, one at a time, so a multi-GB checkpoint never sits in memory whole.
Pickled ``*.bin`` checkpoints are refused: loading them can run arbitrary code. So is a directory
whose weights name one of our commands but lack its completion record (:mod:`.output_dir`).
"""
from __future__ import annotations

import json
import os
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import HFFormatError
from ..safe_io import MIB, UnreadableFile, UnsafePath, confined, open_regular, read_text
from .records import check_complete

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_HEADER_SIZE_BYTES = 8  # a file starts with its JSON header's length, a little-endian u64
_MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses longer headers itself
_MAX_INDEX_BYTES = 256 * MIB  # an index names every tensor once: a few MB for the largest models


# ---- JSON that names nothing twice ----------------------------------------------------------
class DuplicateKey(ValueError):
    """A JSON object with a key twice: ``json`` (and the safetensors library) keep the last silently
    where another reader may take the first, so the file would mean two different things."""

    def __init__(self, key: str, where: str):
        super().__init__(f"{key!r} twice" + (f" in {where}" if where else ""))
        self.key, self.where = key, where


class _Pairs(list):
    """An object's ``(key, value)`` pairs as parsed, before they become a dict."""


def _unique(value, where: str):
    if isinstance(value, _Pairs):
        out = {}
        for key, item in value:
            if key in out:
                raise DuplicateKey(key, where)
            out[key] = _unique(item, f"{where}.{key}" if where else key)
        return out
    if isinstance(value, list):
        return [_unique(item, f"{where}[{i}]") for i, item in enumerate(value)]
    return value


def loads_unique(text):
    """``json.loads`` that raises :class:`DuplicateKey` (naming the key and the object's path) for
    an object holding a key twice."""
    return _unique(json.loads(text, object_pairs_hook=_Pairs), "")


def check_header_names(path: str) -> None:
    """Refuse a safetensors file whose JSON header names a tensor twice, or an entry's field twice.
    Other defects of the header are left to the safetensors library, which reports them."""
    try:
        with open_regular(path) as f:
            size = int.from_bytes(f.read(_HEADER_SIZE_BYTES), "little")
            if size > _MAX_HEADER_BYTES:
                return
            raw = f.read(size)
    except UnreadableFile as e:  # a FIFO or a device would hang or flood the library's reader
        raise HFFormatError(f"{path}: not a readable safetensors file ({e.why})") from None
    except OSError:  # unreadable: the library's message says so
        return
    try:
        loads_unique(raw)
    except DuplicateKey as e:
        what = f"names tensor {e.key!r} twice" if not e.where else f"gives {e.where!r} the field {e.key!r} twice"
        raise HFFormatError(f"{path}: not a readable safetensors file (its header {what}; a name must appear "
                            "once)") from None
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep: the library's message says what
        return


class SafetensorsCheckpoint:
    """Lazy access to the tensors of a checkpoint directory by name (``require_complete``: refuse an
    output of ours whose completion record is missing, see :func:`.records.check_complete`)."""

    def __init__(self, directory: str, require_complete: bool = True):
        self.directory = directory
        self._index_metadata: Optional[dict] = None
        self._handles: dict[str, object] = {}
        single, index = os.path.join(directory, SINGLE), os.path.join(directory, INDEX)
        if os.path.exists(index):
            self.weight_map = self._read_index(index)
        elif os.path.exists(single):
            self.weight_map = {name: SINGLE for name in self._keys_of(SINGLE)}
        else:
            self.weight_map = self._fallback(directory)
        if require_complete:
            check_complete(directory, self.metadata())

    # ---- discovery ----------------------------------------------------------------------
    def _read_index(self, index: str) -> dict[str, str]:
        try:
            data = loads_unique(read_text(index, _MAX_INDEX_BYTES))
            weight_map = data["weight_map"]
            self._index_metadata = dict(data.get("metadata") or {})
        except UnreadableFile as e:
            raise HFFormatError(f"{index}: not a valid safetensors index ({e.why})") from None
        except DuplicateKey as e:
            raise HFFormatError(f"{index}: not a valid safetensors index (it names {e}; a name must appear "
                                "once)") from None
        except (ValueError, KeyError, TypeError, RecursionError) as e:  # ValueError: not JSON
            raise HFFormatError(f"{index}: not a valid safetensors index (expected a JSON object with a "
                                f"'weight_map'): {e}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
            raise HFFormatError(f"{index}: not a valid safetensors index (its 'weight_map' must map tensor names to "
                                "shard file names)")
        shards = sorted(set(weight_map.values()))
        try:
            for shard in shards:
                confined(self.directory, shard, f"{index} (weight_map)")
        except UnsafePath as e:
            raise HFFormatError(str(e)) from None
        missing = [s for s in shards if not os.path.exists(os.path.join(self.directory, s))]
        if missing:
            raise HFFormatError(f"{self.directory}: {len(missing)} of {len(shards)} shards named in {INDEX} are missing: "
                                f"{missing}; download or copy them next to the index")
        return dict(weight_map)

    def _keys_of(self, shard: str) -> list[str]:
        return list(self._handle(shard).keys())

    def _fallback(self, directory: str) -> dict[str, str]:
        if not os.path.isdir(directory):
            raise HFFormatError(f"{directory}: no such checkpoint directory")
        files = sorted(os.listdir(directory))
        shards = [f for f in files if f.endswith(".safetensors")]
        if shards:  # shards without an index: the union of their tensors, each named by one shard only
            found: dict[str, str] = {}
            for shard in shards:
                for name in self._keys_of(shard):
                    if name in found:
                        raise HFFormatError(f"{directory}: tensor {name!r} is in both {found[name]} and {shard} and "
                                            f"there is no {INDEX} to say which holds it; remove the stray shard")
                    found[name] = shard
            return found
        pickled = [f for f in files if f.endswith((".bin", ".pt", ".pth"))]
        if pickled:
            raise HFFormatError(f"{directory}: only pickled weights ({pickled[:3]}) were found; they are not loaded "
                                "because unpickling can run code. Convert them to safetensors first, e.g. "
                                "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)")
        raise HFFormatError(f"{directory}: no {SINGLE}, {INDEX} or *.safetensors file")

    # ---- access -------------------------------------------------------------------------
    def metadata(self) -> dict:
        """The header metadata: the index's, else the first file's."""
        if self._index_metadata is not None:
            return self._index_metadata
        if not self.weight_map:
            return {}
        return dict(self._handle(min(self.weight_map.values())).metadata() or {})

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, shard: str):
        if shard not in self._handles:
            path = os.path.join(self.directory, shard)
            check_header_names(path)
            try:
                self._handles[shard] = safe_open(path, framework="pt")
            except Exception as e:  # safetensors raises several types for a damaged file
                raise HFFormatError(f"{path}: not a readable safetensors file ({e})") from None
        return self._handles[shard]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._shard(name)).get_slice(name).get_shape())

    def _shard(self, name: str) -> str:
        try:
            return self.weight_map[name]
        except KeyError:
            raise HFFormatError(f"{self.directory}: tensor {name!r} is missing from the checkpoint") from None

    def get(self, name: str) -> torch.Tensor:
        shard = self._shard(name)
        try:
            return self._handle(shard).get_tensor(name)
        except Exception as e:
            raise HFFormatError(f"{os.path.join(self.directory, shard)}: cannot read tensor {name!r} "
                                f"(named in the index but unreadable: {e})") from None

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of a tensor's first dimension, read without loading the rest."""
        shard = self._shard(name)
        try:
            return self._handle(shard).get_slice(name)[start:stop]
        except Exception as e:
            raise HFFormatError(f"{os.path.join(self.directory, shard)}: cannot read rows {start}:{stop} of "
                                f"{name!r}: {e}") from None

    def close(self) -> None:
        self._handles.clear()


class ShardedWriter:
    """Write named tensors to ``model-XXXXX-of-YYYYY.safetensors`` shards of about
    ``max_shard_bytes`` each, then an index (or a single ``model.safetensors``)."""

    def __init__(self, directory: str, max_shard_bytes: int = 4 << 30, metadata: Optional[dict] = None):
        self.directory, self.max_bytes = directory, max_shard_bytes
        self.metadata = {k: str(v) for k, v in (metadata or {}).items()}
        os.makedirs(directory, exist_ok=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._storages: set[int] = set()
        self._written: list[tuple[str, list[str]]] = []  # (temporary file, names)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._written):
            raise ValueError(f"tensor {name!r} written twice")
        t = tensor.detach().contiguous()
        size = t.numel() * t.element_size()
        if self._pending and self._pending_bytes + size > self.max_bytes:
            self._flush()
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._storages:  # safetensors refuses tensors that share memory (tied or repeated weights)
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        self._storages.add(ptr)
        self._pending[name] = t
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        tmp = os.path.join(self.directory, f".shard-{len(self._written):05d}.safetensors")
        save_file(self._pending, tmp, metadata={"format": "pt", **self.metadata})
        self._written.append((tmp, list(self._pending)))
        self._pending, self._pending_bytes, self._storages = {}, 0, set()

    def close(self) -> list[str]:
        """Finish the files; returns their names."""
        if self._pending or not self._written:
            self._flush()
        n = len(self._written)
        for name in os.listdir(self.directory):  # files of an earlier write to this directory
            if name == INDEX or (name.startswith("model") and name.endswith(".safetensors")):
                os.remove(os.path.join(self.directory, name))
        if n == 1:
            os.replace(self._written[0][0], os.path.join(self.directory, SINGLE))
            return [SINGLE]
        weight_map, names = {}, []
        for i, (tmp, keys) in enumerate(self._written):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(self.directory, final))
            names.append(final)
            weight_map.update({k: final for k in keys})
        with open(os.path.join(self.directory, INDEX), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": self.total_bytes, **self.metadata}, "weight_map": weight_map}, f,
                      indent=2, sort_keys=True)
        return names
