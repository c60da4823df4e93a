"""Process-wide CPU allocator setting that removes per-step page faults.

glibc serves every allocation of 32 MiB or more (the most its dynamic threshold reaches)
with a fresh ``mmap`` and unmaps it on free, so each step of a large MoE layer touches
hundreds of MiB of new pages (one fault and one page zeroing per 4 KiB; what that costs a
step is on benchmarks/results/layer.md). ``keep_freed_memory()`` makes malloc
serve everything from its heap and never return freed memory to the system, so later steps
reuse the same pages. The price is a resident size that stays at its peak, which a training
process reaches anyway. Call it once at start-up, before the big allocations.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Disable mmap-per-allocation and heap trimming in glibc malloc (this process).

    Returns False (and changes nothing) where the C library is not glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
