"""What the machine runs fast, where it changes a choice the user makes."""
from __future__ import annotations

from typing import Optional

import torch


def cpu_bf16_is_slow(device: torch.device) -> bool:
    """True on a CPU without AVX-512 (or AMX): torch's CPU bf16 matmuls then take a slow path,
    measured 18-29x slower than fp32 for the expert matmuls on an AVX2-only EPYC, against
    about 1x on an AVX-512 machine."""
    if device.type != "cpu":
        return False
    capability = torch.backends.cpu.get_cpu_capability()
    return not ("AVX512" in capability or "AMX" in capability)


def slow_bf16_note(device: torch.device, dtype: str) -> Optional[str]:
    """The warning a training run prints when ``train.dtype=bf16`` would be slow here."""
    if dtype != "bf16" or not cpu_bf16_is_slow(device):
        return None
    return (f"warning: train.dtype=bf16 on a CPU with {torch.backends.cpu.get_cpu_capability()} (no AVX-512): "
            "bf16 matmuls run far slower than fp32 here; train.dtype=fp32 is the faster choice on this machine")


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux and macOS; 0 where unknown)."""
    try:
        import resource
        import sys
    except ImportError:  # not POSIX
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux
