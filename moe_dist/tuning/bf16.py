"""``train.dtype=bf16`` on a CPU whose bf16 matmuls are slow: fp32 instead, decided by timing.

Some CPUs' torch has no fast bf16 matmul kernel for them (a fallback path many times slower than
fp32; figures: ``benchmarks/results/training.md``, "bf16 on CPUs without fast bf16 matmuls"). fp32 trains the
same model faster there; :func:`bf16_choice` says so once and switches, :func:`slow_bf16_note` is
the benchmarks' warning.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Optional

import torch

from .timing import best_times


SLOW_BF16 = 1.5  # a bf16 matmul this many times slower than fp32: fp32 trains the same model faster
PROBE_SHAPE = (256, 512, 512)  # [m, k] x [k, n] when no model size is given (the benchmarks' note)
PROBE_FLOPS = 3e8  # at most this much work per bf16 matmul of the probe (bounded even on a slow fallback path)


def probe_shape(rows: int, d_model: int, d_ff: int) -> tuple[int, int, int]:
    """A matmul like the model's: ``rows`` tokens times the ``d_model`` x ``d_ff`` weight of its
    feed-forward layers, with fewer rows (at least 16), then fewer columns, where that would exceed
    :data:`PROBE_FLOPS`."""
    m = max(16, min(int(rows), int(PROBE_FLOPS // (2 * d_model * d_ff))))
    return m, int(d_model), max(64, min(int(d_ff), int(PROBE_FLOPS // (2 * m * d_model))))


@functools.lru_cache(maxsize=None)
def bf16_matmul_slowdown(m: int = PROBE_SHAPE[0], k: int = PROBE_SHAPE[1], n: int = PROBE_SHAPE[2]) -> float:
    """Time of an [m, k] x [k, n] CPU matmul in bf16 over fp32: after a warm-up, three fp32 / bf16 pairs,
    interleaved, the best of each (wall time, :func:`~.timing.best_times`). Another process on the
    machine slows both of a pair alike, and the best of three is the least disturbed; one probe timed
    once under load can understate a slow fallback path many times over."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    pairs = {dtype: (a.to(dtype), b.to(dtype)) for dtype in (torch.float32, torch.bfloat16)}
    runs = {str(dtype): functools.partial(torch.mm, x, y) for dtype, (x, y) in pairs.items()}
    best = best_times(runs, torch.device("cpu"), 3, clock=time.perf_counter)
    return best[str(torch.bfloat16)] / max(best[str(torch.float32)], 1e-9)


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
