"""Count device-to-host synchronisations in a block of code, on CPU.

On a GPU every read of a device value by the host (``.item()``, ``int(t)``, ``float(t)``,
``bool(t)``, ``if t:``, ``.tolist()``, ``torch.equal``) waits for the device, and so do ops
whose output size depends on the data (``nonzero``, boolean-mask indexing, ``bincount``,
``repeat_interleave`` without ``output_size``, ``unique``, ``masked_select``): CUDA computes
the size and copies it back. On CPU none of that stalls anything, so a test has to look for
the calls themselves:

- every scalar read ends in ``aten._local_scalar_dense`` (``item``, ``int``, ``float``,
  ``bool``, ``__index__``), which a :class:`TorchDispatchMode` sees;
- ``Tensor.tolist`` and ``Tensor.numpy`` read CPU memory directly without the dispatcher, so
  they are wrapped while counting;
- the data-dependent-size ops are seen by the dispatch mode by name.

Each event is recorded with its kind and the line of moe_dist code that caused it, so a
failing assertion says where the new synchronisation is.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

SCALAR_READS = {aten._local_scalar_dense.default}
# ops that synchronise on CUDA because their output size (or result) is read back by the host
SIZE_READS = {
    aten.nonzero.default, aten.nonzero_static.default, aten.masked_select.default, aten.bincount.default,
    aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default, aten.equal.default,
    aten.is_nonzero.default, aten.repeat_interleave.Tensor,
}


def _code_line() -> str:
    """``file:line code`` of the innermost frame outside torch and this module: the line that read."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename.replace("\\", "/")
        if "/torch/" not in name and not name.endswith("/host_sync.py") and "contextlib" not in name:
            return f"{'/'.join(name.split('/')[-3:])}:{frame.lineno} {frame.line}"
    return "unknown"


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(t is not None and torch.is_tensor(t) and t.dtype in (torch.bool, torch.uint8) for t in indices)


@dataclass
class SyncLog:
    events: list = field(default_factory=list)  # (kind, where, tag)
    tag: str = ""  # set by the caller to label the events of a phase (e.g. "update")

    def record(self, kind: str) -> None:
        self.events.append((kind, _code_line(), self.tag))

    def __len__(self) -> int:
        return len(self.events)

    def tagged(self, tag: str) -> list:
        return [e for e in self.events if e[2] == tag]

    def describe(self, events=None) -> str:
        events = self.events if events is None else events
        return "\n".join(f"  {kind}: {where}" + (f" [{tag}]" if tag else "") for kind, where, tag in events) or "  (none)"


class _SyncMode(TorchDispatchMode):
    def __init__(self, log: SyncLog):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SCALAR_READS:
            self.log.record("scalar read")
        elif func in SIZE_READS:
            if not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None):
                self.log.record(f"data-dependent size ({func.__name__})")
        elif func is aten.index.Tensor and _bool_index(args):
            self.log.record("boolean-mask index")
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs():
    """Yields a :class:`SyncLog` that records every host synchronisation inside the block."""
    log = SyncLog()
    wrapped = {}

    def wrap(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, **kwargs):
            log.record(f"Tensor.{name}")
            return original(self, *args, **kwargs)

        wrapped[name] = original
        setattr(torch.Tensor, name, counted)

    try:
        for name in ("tolist", "numpy"):
            wrap(name)
        with _SyncMode(log):
            yield log
    finally:
        for name, original in wrapped.items():
            setattr(torch.Tensor, name, original)
