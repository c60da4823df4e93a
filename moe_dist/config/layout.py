"""The expert-parallel size (``parallel.ep``): which values a number of processes allows, and what
``parallel.ep: auto`` picks.

The processes form a mesh ``(edp, ep)``: contiguous blocks of ``ep`` ranks split each MoE layer's
experts (``moe_dist/distributed/groups.py``), so ``ep`` must divide both the world size and
``model.moe.num_experts``. A checkpoint loads at any of these sizes (experts are keyed by global
index) and the loss curve does not depend on which one runs, so a job may continue on fewer or
more processes with another ``ep``:

- an explicit ``parallel.ep: N`` is kept, or refused (one line naming ``parallel.ep`` and the
  values this number of processes allows) when it does not fit;
- ``parallel.ep: auto`` is the largest allowed size whose every block of ``ep`` consecutive ranks
  runs on one host (same host name), so that the expert all-to-alls never cross the network. With
  the same number of processes on every node and ranks numbered node by node (torchrun, Slurm's
  block distribution, the local launcher) that is the greatest common divisor of
  ``model.moe.num_experts`` and the processes per node; on one machine, of ``num_experts`` and the
  number of processes. It always exists (1 at worst).

Plain functions of numbers and host names (no torch): the config checks them before any process
starts, and every rank applies them to the same gathered host names, so all ranks agree.
"""
from __future__ import annotations

import math
from typing import Sequence

from ..errors import ConfigError

AUTO = "auto"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def ep_sizes(world_size: int, num_experts: int) -> list[int]:
    """Every expert-parallel size allowed on ``world_size`` processes: the common divisors."""
    return divisors(math.gcd(world_size, num_experts))


def _allowed(sizes: Sequence[int]) -> str:
    return ", ".join(str(s) for s in sizes) + f" or {AUTO}"


def check_ep(ep: int, num_experts: int, world_size: int | None = None) -> None:
    """Refuse an explicit ``parallel.ep`` that does not divide ``num_experts`` or (when known) the
    world size, naming the sizes that are allowed."""
    if num_experts % ep:
        raise ConfigError(f"parallel.ep: {ep} must divide model.moe.num_experts={num_experts}; allowed: "
                          + _allowed(divisors(num_experts)))
    if world_size is not None and world_size % ep:
        raise ConfigError(f"parallel.ep: {ep} must divide the world size {world_size}; allowed on {world_size} "
                          f"process(es) with model.moe.num_experts={num_experts}: "
                          + _allowed(ep_sizes(world_size, num_experts)))


def auto_ep(num_experts: int, hosts: Sequence[str]) -> int:
    """``parallel.ep: auto`` on ``len(hosts)`` processes, ``hosts[r]`` being rank r's host name: the
    largest allowed size whose every block of consecutive ranks lies on one host."""
    for size in reversed(ep_sizes(len(hosts), num_experts)):
        if all(len(set(hosts[start:start + size])) == 1 for start in range(0, len(hosts), size)):
            return size
    raise AssertionError("unreachable: a size of 1 always fits")


def expert_parallel_size(ep: int | str, num_experts: int, hosts: Sequence[str]) -> int:
    """The expert-parallel size of a job whose rank r runs on ``hosts[r]``: ``ep`` checked, or auto's choice."""
    if ep == AUTO:
        return auto_ep(num_experts, hosts)
    check_ep(ep, num_experts, len(hosts))
    return ep
