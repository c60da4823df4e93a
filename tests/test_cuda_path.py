"""The CUDA path, checked on a machine without a GPU (torch.cuda mocked where the code asks it).

What these prove: the order and arguments of the CUDA start-up calls (the allocator setting, then
``set_device(LOCAL_RANK)``, then NCCL with ``device_id``), that batches travel through pinned
memory with non-blocking copies, and that the CUDA memory peaks reach the metrics. What they
cannot prove (a real GPU run only): that the copies overlap, NCCL itself, the memory figures'
values. docs/scale.md lists both.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moe_dist import hardware
from moe_dist.distributed import bootstrap


@pytest.fixture
def fake_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda dev: calls.append(("set_device", str(dev))))
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # unset, and restored after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return calls


def test_each_rank_takes_its_local_gpu_before_the_process_group(fake_cuda, monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def init_process_group(backend, **kwargs):
        import os

        seen.update(backend=backend, device_id=str(kwargs.get("device_id")), calls=list(fake_cuda),
                    alloc=os.environ.get("PYTORCH_ALLOC_CONF"))
        raise Stop

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29999"}
    with pytest.raises(Stop):
        bootstrap.init_distributed(ep=1, num_experts=4, environ=env)
    # local rank 3 of a 2-GPU node wraps to cuda:1, set before NCCL is initialised, which gets the device
    assert seen == {"backend": "nccl", "device_id": "cuda:1", "calls": [("set_device", "cuda:1")],
                    "alloc": hardware.CUDA_ALLOC_CONF}


def test_the_users_allocator_setting_is_kept(fake_cuda, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert bootstrap.pick_device("auto", 0) == torch.device("cuda", 0)
    import os

    assert "PYTORCH_ALLOC_CONF" not in os.environ


def test_batches_go_through_pinned_memory_without_waiting(monkeypatch):
    batch = np.arange(12, dtype=np.int64).reshape(3, 4)
    on_cpu = hardware.batch_to_device(batch, torch.device("cpu"))
    assert on_cpu.data_ptr() == torch.from_numpy(batch).data_ptr() or np.shares_memory(on_cpu.numpy(), batch)
    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device, non_blocking=False: calls.append(
        ("to", str(device), non_blocking)) or self)
    hardware.batch_to_device(batch, torch.device("cuda", 1))
    assert calls == ["pin", ("to", "cuda:1", True)]


def test_cuda_memory_peaks_reach_the_metrics(monkeypatch):
    assert hardware.cuda_memory_gib(torch.device("cpu")) == {}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda dev: 4.5 * 2**30)
    assert hardware.cuda_memory_gib(torch.device("cuda", 0)) == {"cuda_peak_allocated_gib": 3.0,
                                                                 "cuda_peak_reserved_gib": 4.5}
