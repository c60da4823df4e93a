"""Steps shared by routers whose statistics couple tokens across ranks (SSR, AC): the
real-token weights and coins every rank draws alike."""
from __future__ import annotations

from typing import Optional

import torch

from ..routing.types import RouterInputs, RoutingContext


def real_token_weights(inputs: RouterInputs, ctx: RoutingContext, num_tokens: int, device) -> Optional[torch.Tensor]:
    """``[T]`` fp32 weights, 1 for real tokens and 0 for padding, from ``inputs.padding_mask``
    (``[B, S]``, True = real), or None when there is no mask (every token is real)."""
    mask = inputs.padding_mask
    if mask is None:
        return None
    if mask.numel() != num_tokens:
        raise ValueError(f"layer {ctx.layer_idx}: padding_mask has {mask.numel()} entries for {num_tokens} router tokens")
    return mask.reshape(-1).to(device=device, dtype=torch.float32)


_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def shared_uniform(*keys: int) -> float:
    """A number in [0, 1) that depends only on the integer ``keys`` (no RNG state), so every
    rank that passes the same keys draws the same value, and a recomputed forward too."""
    h = 0
    for key in keys:
        h = _splitmix64(h ^ (int(key) & _MASK64))
    return (h >> 11) / float(1 << 53)
