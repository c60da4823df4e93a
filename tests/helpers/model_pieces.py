"""What a rank holds of a parallelized model, for the tests that put the ranks' parts together
(tests/test_scale_layout.py, tests/test_expert_shard.py)."""
from __future__ import annotations

from moe_dist.train.checkpoint import expert_keyed_state_dict


def pieces(model) -> dict:
    """What this rank holds, as whole tensors by layout-independent key (DTensors gathered)."""
    out = {}
    for key, t in expert_keyed_state_dict(model).items():
        out[key] = (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
    return out


def local_numel(tensors) -> int:
    """Elements this rank stores of ``tensors`` (a DTensor's local shard)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() for t in tensors)
