"""Every process's random-number generator states as tensors, for a checkpoint.

They are host state: every tensor here is made on the CPU explicitly, whatever the default device.

Keys ``rng.rank_<r>.<generator>`` (torch CPU and accelerator, numpy, Python): each rank saves
its own, and on load restores the states of the rank of the same index when the checkpoint
has them. Nothing the training computes depends on them (the data order and the routing
noise follow from the seed, the step and the global token index), so a resume at another
world size loses nothing.
"""
from __future__ import annotations

import random

import numpy as np
import torch

RNG = "rng."


def rng_prefix(rank: int) -> str:
    return f"{RNG}rank_{rank:05d}."


def rng_state(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This process's torch (CPU and accelerator), numpy and Python RNG states, as tensors."""
    p = rng_prefix(rank)
    out = {p + "torch_cpu": torch.get_rng_state()}
    if device.type != "cpu":
        out[p + f"torch_{device.type}"] = torch.get_device_module(device.type).get_rng_state(device)
    _kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out[p + "numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    out[p + "numpy_pos"] = torch.tensor([pos, has_gauss], dtype=torch.int64, device="cpu")
    out[p + "numpy_gauss"] = torch.tensor([gauss], dtype=torch.float64, device="cpu")
    _version, internal, gauss_next = random.getstate()
    out[p + "python_state"] = torch.tensor(internal, dtype=torch.int64, device="cpu")
    out[p + "python_gauss"] = torch.tensor([gauss_next is not None, gauss_next or 0.0], dtype=torch.float64,
                                       device="cpu")
    return out


def set_rng_state(rank: int, device: torch.device, state: dict[str, torch.Tensor]) -> None:
    p = rng_prefix(rank)
    torch.set_rng_state(state[p + "torch_cpu"])
    if device.type != "cpu" and p + f"torch_{device.type}" in state:
        torch.get_device_module(device.type).set_rng_state(state[p + f"torch_{device.type}"], device)
    pos, has_gauss = (int(v) for v in state[p + "numpy_pos"])
    np.random.set_state(("MT19937", state[p + "numpy_keys"].numpy().astype(np.uint32), pos, has_gauss,
                         float(state[p + "numpy_gauss"][0])))
    flag, value = (float(v) for v in state[p + "python_gauss"])
    random.setstate((3, tuple(int(v) for v in state[p + "python_state"]), value if flag else None))

