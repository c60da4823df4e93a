"""The machine: device synchronisation, batches onto the device, allocator settings, memory
counters, datasheet peaks. Choices made by timing the machine live in :mod:`moe_dist.tuning`."""
from __future__ import annotations

import os
import time
from typing import Optional

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU): around a timed region."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def batch_to_device(batch, device: torch.device) -> torch.Tensor:
    """A host batch (numpy array or CPU tensor) on ``device``. On a GPU it goes through pinned
    memory with a non-blocking copy, so the host queues the copy and goes on (a copy from pageable
    memory waits for it); on the CPU it is the same memory, not copied."""
    t = torch.from_numpy(batch) if not torch.is_tensor(batch) else batch
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


CUDA_ALLOC_CONF = "expandable_segments:True"  # fewer fragmented blocks when MoE token counts change every step


def default_allocator_settings(environ=None) -> None:
    """Before CUDA allocates: PyTorch's caching allocator with expandable segments, unless the user
    set ``PYTORCH_ALLOC_CONF`` or ``PYTORCH_CUDA_ALLOC_CONF`` (dropless MoE layers allocate buffers
    of a different size every step, which fragments fixed segments)."""
    env = os.environ if environ is None else environ
    if "PYTORCH_ALLOC_CONF" not in env and "PYTORCH_CUDA_ALLOC_CONF" not in env:
        env["PYTORCH_ALLOC_CONF"] = CUDA_ALLOC_CONF


def cuda_memory_gib(device: torch.device) -> dict[str, float]:
    """This process's peak CUDA memory so far, allocated (tensors) and reserved (the allocator's
    segments), in GiB; empty off CUDA. Reads the allocator's counters: no device synchronisation."""
    if device.type != "cuda":
        return {}
    return {"cuda_peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
            "cuda_peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 3)}


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def map_large_allocations(threshold: int = 1 << 20) -> bool:
    """glibc: serve every allocation of ``threshold`` bytes or more with a mapping of its own,
    unmapped when freed. glibc's default threshold grows to the largest block freed so far (up to
    32 MiB), so FSDP2's gathered weights and their all-gather buffers (megabytes each) land in the
    heap, whose fragmentation keeps memory that was freed (benchmarks/results/scale.md: the 3.76B model's
    evaluation). A fixed threshold also stops that growth. No-op where glibc is absent or
    ``MALLOC_MMAP_THRESHOLD_`` is set (the user's choice). Returns whether it was applied."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux and macOS; 0 where unknown)."""
    try:
        import resource
        import sys
    except ImportError:  # not POSIX
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


# dense bf16 TFLOP/s (no sparsity) of known GPUs, by a part of the device name; the first match wins
DATASHEET_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("GH200", 989.0), ("H200", 989.0), ("H100", 989.0),
                         ("A100", 312.0))


def datasheet_tflops(gpu_name: Optional[str]) -> Optional[float]:
    """Dense bf16 TFLOP/s of a known GPU (by name), else None."""
    for key, tflops in DATASHEET_BF16_TFLOPS:
        if gpu_name and key in gpu_name:
            return tflops
    return None


def matmul_peak(dtype: torch.dtype, threads: Optional[int] = None, n: int = 2048, seconds: float = 2.0,
                device: torch.device = torch.device("cpu")) -> float:
    """FLOP/s of an ``n x n`` matmul on ``device`` (on the CPU with ``threads`` threads, default: as
    set now), the best of the repeats that fit in ``seconds``."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n).to(device, dtype), torch.randn(n, n).to(device, dtype)
        a @ b  # warm-up
        synchronize(device)
        best, end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            a @ b
            synchronize(device)
            best = min(best, time.perf_counter() - t0)
        return 2 * n ** 3 / best
    finally:
        torch.set_num_threads(before)
