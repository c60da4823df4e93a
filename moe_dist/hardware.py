"""What the machine runs fast, where it changes a choice the user makes."""
from __future__ import annotations

import functools
import os
import time
from typing import Callable, Optional

import torch


SLOW_BF16 = 1.5  # a bf16 matmul this many times slower than fp32: fp32 trains the same model faster
PROBE_SHAPE = (256, 512, 512)  # [m, k] x [k, n] when no model size is given (the benchmarks' note)
PROBE_FLOPS = 3e8  # at most this much work per bf16 matmul of the probe: ~0.3 s on a 1 GFLOP/s fallback path


def probe_shape(rows: int, d_model: int, d_ff: int) -> tuple[int, int, int]:
    """A matmul like the model's: ``rows`` tokens times the ``d_model`` x ``d_ff`` weight of its
    feed-forward layers, with fewer rows (at least 16), then fewer columns, where that would exceed
    :data:`PROBE_FLOPS`."""
    m = max(16, min(int(rows), int(PROBE_FLOPS // (2 * d_model * d_ff))))
    return m, int(d_model), max(64, min(int(d_ff), int(PROBE_FLOPS // (2 * m * d_model))))


@functools.lru_cache(maxsize=None)
def bf16_matmul_slowdown(m: int = PROBE_SHAPE[0], k: int = PROBE_SHAPE[1], n: int = PROBE_SHAPE[2]) -> float:
    """Time of an [m, k] x [k, n] CPU matmul in bf16 over fp32: after a warm-up, three fp32 / bf16 pairs,
    interleaved, the best of each. Another process on the machine slows both of a pair alike, and the
    best of three is the least disturbed: a small probe timed once under load measured a fallback
    path 90x slower than fp32 as under 4x."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    pairs = {dtype: (a.to(dtype), b.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    best = {dtype: float("inf") for dtype in pairs}
    for x, y in pairs.values():
        torch.mm(x, y)
    for _ in range(3):
        for dtype, (x, y) in pairs.items():
            t0 = time.perf_counter()
            torch.mm(x, y)
            best[dtype] = min(best[dtype], time.perf_counter() - t0)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


def bf16_slowdown(device: torch.device, shape: tuple[int, int, int] = PROBE_SHAPE,
                  agree: Callable[[float], float] = lambda ratio: ratio) -> Optional[float]:
    """How many times slower than fp32 a bf16 matmul of ``shape`` runs on ``device`` when that is
    :data:`SLOW_BF16` or more (a CPU whose torch has no fast bf16 kernel for it), else None. ``agree``
    turns this process's figure into the job's (the largest over its ranks: every rank decides
    alike). The one rule behind :func:`bf16_choice` and :func:`slow_bf16_note`; GPUs are not probed."""
    if device.type != "cpu":
        return None
    ratio = agree(bf16_matmul_slowdown(*shape))
    return ratio if ratio >= SLOW_BF16 else None


def bf16_choice(device: torch.device, dtype: str, on_slow_cpu: str = "fp32", shape: tuple[int, int, int] = PROBE_SHAPE,
                agree: Callable[[float], float] = lambda ratio: ratio) -> tuple[str, Optional[str]]:
    """``(dtype to run, one line to print or None)`` for ``train.dtype``. On a CPU whose bf16 matmul of the
    model's size (``shape``, :func:`probe_shape`) measures :data:`SLOW_BF16` or more times fp32's, bf16
    becomes fp32 unless ``on_slow_cpu == "bf16"`` (``train.bf16_on_slow_cpu``). The same model either way
    (fp32 master weights; autocast only rounds the matmul inputs), so the fallback costs no accuracy;
    refusing instead would stop every bf16 preset on such machines for a choice that only affects speed."""
    ratio = bf16_slowdown(device, shape, agree) if dtype == "bf16" else None
    if ratio is None:
        return dtype, None
    m, k, n = shape
    why = (f"bf16 matmuls of the model's size ({m}x{k} by {k}x{n}) measured {ratio:.1f}x slower than fp32 on "
           f"this CPU ({torch.backends.cpu.get_cpu_capability()})")
    if on_slow_cpu == "bf16":
        return dtype, f"warning: train.dtype=bf16 kept (train.bf16_on_slow_cpu=bf16): {why}; train.dtype=fp32 is faster"
    return "fp32", (f"train.dtype=bf16 runs as fp32: {why}; fp32 trains the same model faster "
                    "(train.bf16_on_slow_cpu=bf16 keeps bf16)")


def slow_bf16_note(device: torch.device, dtype: str) -> Optional[str]:
    """The one line a benchmark that times ``dtype`` as asked prints on such a CPU, or None."""
    ratio = bf16_slowdown(device) if dtype == "bf16" else None
    if ratio is None:
        return None
    return (f"warning: bf16 on this CPU ({torch.backends.cpu.get_cpu_capability()}): bf16 matmuls measured "
            f"{ratio:.1f}x slower than fp32 here, so the bf16 figures say little about bf16 elsewhere; "
            "train.dtype=fp32 (or --dtypes fp32) is the faster choice on this machine")


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
    heap, whose fragmentation keeps memory that was freed (bench/results.md: the 3.76B model's
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


def matmul_peak(dtype: torch.dtype, threads: Optional[int] = None, n: int = 2048, seconds: float = 2.0) -> float:
    """FLOP/s of an ``n x n`` matmul on the CPU with ``threads`` threads (default: as set now), the
    best of the repeats that fit in ``seconds``."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # warm-up
        best, end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return 2 * n ** 3 / best
    finally:
        torch.set_num_threads(before)
