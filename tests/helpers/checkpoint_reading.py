"""Reading a checkpoint whole on one process, and comparing tensors, for the checkpoint tests
(tests/test_checkpoint.py, tests/test_expert_shard.py)."""
from __future__ import annotations

import warnings

import torch

from moe_dist.train.checkpoint.files import SafeFileSystemReader


def read_full(path):
    """Every tensor of a checkpoint, whole, read on this one process."""
    import torch.distributed.checkpoint as dcp

    reader = SafeFileSystemReader(path)
    saved = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in saved.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {k: v for k, v in state.items() if not k.startswith("rng.")}


def rel_diff(a, b):
    """The norm of ``a - b`` relative to ``b``'s (0 for empty tensors)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) if b.numel() else 0.0
