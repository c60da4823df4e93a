"""Reading torch.distributed.checkpoint (DCP) directories as data, never as code.

DCP keeps its index (``.metadata``) as a pickle, reads each tensor record with
``torch.load(weights_only=True)`` and each *bytes* entry with ``torch.load(weights_only=False)``,
which runs whatever the pickle asks for. :class:`SafeFileSystemReader` is the reader every
loader of moe_dist checkpoints uses: the index through an unpickler that accepts only the
classes DCP's metadata consists of (:data:`METADATA_CLASSES`) and dtypes; then, before a byte
of data is read, every entry must be a tensor stored in one of the directory's own ``*.distcp``
files, with no stream transform; tensor records must unpickle, weights-only, to plain tensors
of the declared dtype and shape. Anything else raises :class:`~moe_dist.errors.UnsafeCheckpoint` (one line,
naming the entry). For directories another framework loads (Megatron-Core keeps module extra
state as pickled bytes entries), ``allow_objects=True`` admits bytes entries whose pickles need
nothing beyond the weights-only allowlist (:meth:`SafeFileSystemReader.vet_objects`).
"""
from __future__ import annotations

import enum
import io
import os
import pickle
from typing import Optional

import torch
from torch.distributed.checkpoint import FileSystemReader

from .errors import DamagedCheckpoint, UnsafeCheckpoint
from .safe_io import UnreadableFile, open_regular

# Every class a DCP ``.metadata`` pickle refers to, written out. The set was found by saving real
# checkpoints (moe_dist's checkpointer at 1 and 2 ranks, sync and async, FSDP and DeepSpeed; raw DCP
# saves of every dtype, bytes entries and nested containers; Megatron-Core's torch_dist format) and
# recording every (module, name) the unpickler asked for. Naming them one by one matters: DCP's
# modules also import classes that run code when called (TCPStore, ThreadPoolExecutor, pstats.Stats,
# multiprocessing connections), and a rule such as "any class found in a DCP module" admits those.
# tests/test_checkpoint_security.py fails when torch adds a data class to these modules that is
# neither here nor listed there as never saved.
METADATA_CLASSES = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),  # TensorProperties' memory format
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # where each entry is: file, offset, length
    # Megatron-Core keeps the ranks' save plans in the metadata (``all_local_plans``) to reuse them
    ("torch.distributed.checkpoint.planner", "SavePlan"),
    ("torch.distributed.checkpoint.planner", "WriteItem"),
    ("torch.distributed.checkpoint.planner", "WriteItemType"),
    ("torch.distributed.checkpoint.planner", "TensorWriteData"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how a torch.layout pickles (TensorProperties.layout)
    # StorageMeta.checkpoint_id, a path (Python 3.13 moved the classes to pathlib._local); a path
    # saved on Windows is a WindowsPath
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "WindowsPath"),
})
# values of module ``torch`` a metadata pickle names: dtypes (TensorProperties.dtype); layouts and
# memory formats as torch versions that pickled them by name did
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _Refused(pickle.UnpicklingError):
    """The metadata pickle asked for an object outside the allowlist."""


def _enum_member(cls, name: str):
    """``getattr(cls, name)`` restricted to an enum's members: how early Python 3.11 releases (Debian
    bookworm's 3.11.2, the Docker image's) pickle an enum member; anything else is refused (a free
    getattr would let a pickle reach any attribute of an allowed class)."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise _Refused(f"checkpoint metadata asks for getattr({getattr(cls, '__name__', type(cls).__name__)}, "
                                 f"{name!r}), which is not an enum member; refusing to unpickle it")


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only what DCP metadata consists of (:data:`METADATA_CLASSES`), dtypes, and enum
    members in the form early Python 3.11 releases pickle them."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        value = vars(torch).get(name) if module == "torch" else None  # (vars: no lazy import of a submodule)
        if isinstance(value, _TORCH_VALUES):
            return value
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        raise _Refused(f"checkpoint metadata refers to {module}.{name}, which a checkpoint's metadata "
                                     "never holds; refusing to unpickle it")


def _refuse_unsafe_entries(directory: str, metadata, allow_objects: bool = False) -> None:
    """Refuse DCP metadata that a moe_dist save never writes: an entry that is not a tensor (DCP
    unpickles a bytes entry with ``weights_only=False``, which runs whatever the pickle asks for;
    with ``allow_objects`` bytes entries pass here and :meth:`SafeFileSystemReader.vet_objects`
    checks them), a storage record outside the checkpoint directory's own files, a stream
    transform."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise DamagedCheckpoint(f"{directory}: its .metadata is not DCP metadata (no entry or storage tables)")
    for key, md in entries.items():
        if not isinstance(md, TensorStorageMetadata) and not (allow_objects and isinstance(md, BytesStorageMetadata)):
            raise UnsafeCheckpoint(f"checkpoint {directory} declares entry {key!r} as {type(md).__name__}, not a "
                                   "tensor; a moe_dist checkpoint holds only tensors and JSON, and reading this entry "
                                   "would unpickle arbitrary objects, so nothing was loaded")
        if isinstance(md, TensorStorageMetadata):
            problem = _tensor_metadata_problem(md)
            if problem:
                raise DamagedCheckpoint(f"{directory}: its .metadata declares entry {key!r} with {problem}; nothing "
                                        "was loaded")
    files = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    for index, info in storage.items():
        where = getattr(index, "fqn", index)
        rel = getattr(info, "relative_path", None)
        if (not isinstance(rel, str) or rel != os.path.basename(rel) or rel.startswith(".")
                or not rel.endswith(".distcp") or rel not in files):
            raise UnsafeCheckpoint(f"checkpoint {directory}: entry {where!r} is stored in {rel!r}, which is not one of "
                                   "the checkpoint's own data files (*.distcp); nothing was loaded")
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpoint(f"checkpoint {directory}: entry {where!r} asks for stream transforms "
                                   f"{list(info.transform_descriptors)}, which moe_dist never writes; nothing was loaded")
        if where not in entries:
            raise UnsafeCheckpoint(f"checkpoint {directory}: storage record for {where!r}, an entry the metadata does "
                                   "not declare; nothing was loaded")


def _tensor_metadata_problem(md) -> Optional[str]:
    """What of a tensor entry's metadata is not of the form DCP writes (properties with a dtype, a
    size and chunks of non-negative integers that fit in it), or None."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties

    def dims(value) -> bool:
        return isinstance(value, (torch.Size, tuple, list)) and all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 62 for d in value)

    if not isinstance(md.properties, TensorProperties) or not isinstance(md.properties.dtype, torch.dtype):
        return f"properties {type(md.properties).__name__} (expected TensorProperties with a dtype)"
    if not dims(md.size):
        return f"size {md.size!r} (expected non-negative integers)"
    if not isinstance(md.chunks, list):
        return f"chunks {type(md.chunks).__name__} (expected a list)"
    for chunk in md.chunks:
        if (not isinstance(chunk, ChunkStorageMetadata) or not dims(chunk.offsets) or not dims(chunk.sizes)
                or len(chunk.offsets) != len(md.size) or len(chunk.sizes) != len(md.size)
                or any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, md.size))):
            return f"a chunk {chunk!r} that is not a block of its {list(md.size)} tensor"
    return None


def _record(stream, info) -> io.BytesIO:
    """The bytes of one storage record (``info``: its offset and length in the open file ``stream``)."""
    from torch.distributed.checkpoint.utils import _create_file_view

    return io.BytesIO(_create_file_view(stream, info.offset, info.length).read())


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader that reads only data: ``.metadata`` through an allowlist unpickler and
    checked by :func:`_refuse_unsafe_entries`; tensors with ``torch.load(weights_only=True)``,
    each checked to be a plain tensor of the declared dtype before it is copied; pickled bytes
    entries never (:class:`UnsafeCheckpoint`).

    ``allow_objects=True`` is for checking a checkpoint another framework will load (Megatron-Core
    stores module extra state as bytes entries): bytes entries then pass the metadata check, and
    :meth:`vet_objects` requires each to unpickle under ``weights_only=True``."""

    def __init__(self, path, allow_objects: bool = False):
        super().__init__(path)
        self.allow_objects = allow_objects

    def vet_objects(self, metadata) -> None:
        """Read every bytes entry of ``metadata`` with ``torch.load(weights_only=True)``: a pickle that
        needs nothing outside that allowlist builds the same objects, and runs no code, under any
        unpickler. :class:`UnsafeCheckpoint` names the first entry that needs more."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        objects = {k for k, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata)}
        for index, info in metadata.storage_data.items():
            if index.fqn not in objects:
                continue
            with open(os.path.join(str(self.path), info.relative_path), "rb") as f:
                record = _record(f, info)
            try:
                torch.load(record, map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001 - any refusal of the weights-only unpickler
                raise UnsafeCheckpoint(f"checkpoint {self.path}: entry {index.fqn!r} is a pickled object that needs "
                                       f"more than tensors and plain containers ({type(e).__name__}); nothing was "
                                       "loaded") from None

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        try:
            with open_regular(str(path)) as f:  # never a FIFO or a device: a reader must not hang or fill memory
                data = f.read()
        except UnreadableFile as e:
            raise DamagedCheckpoint(f"{e}; nothing was loaded") from None
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except _Refused as e:
            raise UnsafeCheckpoint(f"{path}: {e}; nothing was loaded") from None
        except Exception as e:  # noqa: BLE001 - any failure means the file is not usable metadata
            raise DamagedCheckpoint(f"{path}: not readable checkpoint metadata ({e})") from None
        _refuse_unsafe_entries(str(self.path), metadata, self.allow_objects)
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._declared = metadata.state_dict_metadata  # each entry's dtype, checked as it is read

    def read_data(self, plan, planner):
        from torch.distributed._shard._utils import narrow_tensor_by_index
        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.futures import Future

        per_file: dict[str, list] = {}
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise UnsafeCheckpoint(f"checkpoint {self.path}: entry {item.dest_index.fqn!r} is pickled bytes, which "
                                       "moe_dist never unpickles; nothing was loaded")
            info = self.storage_data.get(item.storage_index)
            if info is None:
                raise DamagedCheckpoint(f"checkpoint {self.path}: no storage record for entry {item.dest_index.fqn!r} "
                                        f"at offsets {list(item.storage_index.offset or [])}")
            per_file.setdefault(info.relative_path, []).append((item, info))
        for rel, items in per_file.items():
            with open(os.path.join(str(self.path), rel), "rb") as stream:
                for item, info in items:
                    fqn = item.dest_index.fqn
                    try:
                        tensor = torch.load(_record(stream, info), map_location="cpu", weights_only=True)
                    except pickle.UnpicklingError:
                        raise UnsafeCheckpoint(f"checkpoint {self.path}: entry {fqn!r} in {rel} is not a plain tensor: "
                                               "its pickle asks for objects a tensor never needs (torch.load with "
                                               "weights_only=True refused it); nothing more was loaded") from None
                    except Exception as e:  # noqa: BLE001 - a truncated or scrambled record
                        raise DamagedCheckpoint(f"checkpoint {self.path}: entry {fqn!r} in {rel} is not readable "
                                                f"({type(e).__name__}: {e})") from None
                    if type(tensor) is not torch.Tensor:
                        raise UnsafeCheckpoint(f"checkpoint {self.path}: entry {fqn!r} in {rel} holds a "
                                               f"{type(tensor).__name__}, not a tensor; nothing more was loaded")
                    md = self._declared.get(fqn)
                    if md is not None and tensor.dtype != md.properties.dtype:
                        raise DamagedCheckpoint(f"checkpoint {self.path}: entry {fqn!r} in {rel} holds a {tensor.dtype} "
                                                f"tensor where its metadata declares {md.properties.dtype}")
                    tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != tensor.size():
                        raise DamagedCheckpoint(f"checkpoint {self.path}: entry {fqn!r} in {rel} has shape "
                                                f"{list(tensor.size())} where {list(target.size())} was expected")
                    target.copy_(tensor)
                    planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done
