"""Test-only shim: just enough to run Megatron-Core's MoE layer on a CPU with gloo.

megatron-core 0.16 calls CUDA-only functions on paths the MoE layer takes even when every
tensor lives on the CPU, and misses a symbol when Transformer Engine is absent. This module
patches those calls *in the test process only*; ``moe_dist`` never imports it, and on a GPU
none of it is needed.

  - ``torch.cuda.current_device()``: buffers and all-gather outputs are allocated on it
    -> the CPU device;
  - ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` and ``Tensor.record_stream``: the
    all-to-all dispatcher copies its split sizes on a side stream -> no-op stand-ins;
  - the all-to-all dispatcher's ``maybe_move_tensor_to_cpu`` hands numpy arrays (on a GPU,
    copies of device tensors) to ``all_to_all_single``; on a CPU the tensors are returned
    unchanged and gloo refuses tensor split sizes -> Python lists;
  - ``torch.cuda.synchronize``: distributed checkpointing waits for the device before it
    writes -> no-op (CPU tensors are ready);
  - ``moe_utils.te_general_gemm`` is referenced but not defined without Transformer Engine
    -> None (the plain matmul path).
"""
from __future__ import annotations

import contextlib
import warnings

import torch

_APPLIED = False


class _NoEvent:
    """Stands in for a CUDA event: already complete."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        pass


class _NoStream:
    """Stands in for a CUDA stream: nothing to wait for, nothing to record."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return _NoEvent()

    def __eq__(self, other) -> bool:
        return isinstance(other, _NoStream)

    def __hash__(self) -> int:
        return 0


def _to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.tolist()
    return tensor


def apply() -> None:
    """Install the patches (idempotent). Call before building any Megatron-Core module."""
    global _APPLIED
    if _APPLIED:
        return
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TE) .*not installed.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.Stream = _NoStream
    torch.cuda.current_stream = lambda device=None: _NoStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None
    torch.cuda.synchronize = lambda device=None: None

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    _APPLIED = True
