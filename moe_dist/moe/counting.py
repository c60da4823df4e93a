"""Counting values into a fixed number of bins without a host synchronisation.

``torch.bincount`` sizes its output from the data (``max + 1``), so on CUDA it reads the
maximum back to the host before it can allocate. The MoE hot path always knows the number
of bins (experts, heads, expert pairs), so it counts with a scatter-add into a tensor of
that size instead.
"""
from __future__ import annotations

from typing import Optional

import torch


def count_values(values: torch.Tensor, bins: int, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """How often each of ``0 .. bins - 1`` occurs in ``values`` (any shape, int64), as an int64
    ``[bins]`` tensor; with ``weights`` (same shape), the sum of the weights per value instead
    (in the weights' dtype). Every value must lie in ``[0, bins)``."""
    flat = values.reshape(-1)
    src = torch.ones_like(flat) if weights is None else weights.reshape(-1)
    return torch.zeros(bins, dtype=src.dtype, device=flat.device).scatter_add_(0, flat, src)
