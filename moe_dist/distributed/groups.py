"""Named process groups for data, expert and expert-data parallelism.

Layout: ``world = dp`` (every rank holds distinct tokens). Expert-parallel groups are
contiguous blocks of ``ep`` ranks (``[0..ep-1], [ep..2ep-1], ...``); the expert-data-
parallel group of a rank is the strided set of ranks that hold the same experts
(``{r % ep + i*ep}``).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional, Sequence

import torch.distributed as dist

from ..errors import ConfigError
from .topology import NodeLayout

# the timeout every group is created with (parallel.timeout_s; set by init_distributed), so that a
# collective on any group, not only the default one, gives up after it instead of torch's 30 minutes
_timeout: Optional[datetime.timedelta] = None
# id(group) -> (name, global ranks) of the groups made here, kept after the groups are destroyed so that
# an error report written afterwards can still name them (None = the default group)
_named: dict[Optional[int], tuple[str, list[int]]] = {}


def set_group_timeout(seconds: Optional[float]) -> None:
    """The timeout of the groups created from now on by :func:`new_group` (None = torch's default)."""
    global _timeout
    _timeout = None if seconds is None else datetime.timedelta(seconds=seconds)


def group_timeout() -> Optional[datetime.timedelta]:
    return _timeout


def new_group(ranks: Optional[Sequence[int]] = None, backend: Optional[str] = None,
              name: str = "") -> dist.ProcessGroup:
    """``dist.new_group`` with the configured timeout (collective: every rank calls it)."""
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    group = dist.new_group(ranks, timeout=_timeout, backend=backend)
    _named[id(group)] = (name, ranks)
    return group


def describe_group(group) -> Optional[tuple[str, list[int]]]:
    """(name, global ranks) of a group made by :func:`new_group` or the default group, else None."""
    if group is None or (dist.is_initialized() and group is dist.group.WORLD):
        if None not in _named and dist.is_initialized():
            _named[None] = _named[id(dist.group.WORLD)] = ("world", list(range(dist.get_world_size())))
        return _named.get(None)
    return _named.get(id(group))


@dataclass
class ParallelGroups:
    """The groups an MoE model needs. ``None`` groups mean 'this process alone'."""

    dp: Optional[dist.ProcessGroup] = None  # ranks holding distinct tokens (router statistics)
    ep: Optional[dist.ProcessGroup] = None  # all-to-all among ranks that split the experts
    edp: Optional[dist.ProcessGroup] = None  # ranks holding the same experts (expert grads)
    ep_size: int = 1
    ep_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    edp_size: int = 1
    ep_nodes: Optional[NodeLayout] = None  # the node of each ep peer, in ep rank order (None: all on one node)
    dispatch: str = "flat"  # how tokens reach the ep peers: flat, or hierarchical (node-aware; moe_dist.moe.dispatch.hierarchical)
    ep_node: Optional[dist.ProcessGroup] = None  # hierarchical: this rank's ep peers on its node
    ep_rail: Optional[dist.ProcessGroup] = None  # hierarchical: the ep peers in this rank's position on every node

    def __post_init__(self):
        if self.ep_nodes is None:
            self.ep_nodes = NodeLayout((0,) * self.ep_size)
        if self.ep_nodes.size != self.ep_size:
            raise ValueError(f"ep_nodes names {self.ep_nodes.size} ep ranks, the ep group has {self.ep_size}")

    @classmethod
    def single(cls) -> "ParallelGroups":
        return cls()


def build_parallel_groups(ep_size: int, num_experts: Optional[int] = None,
                          node_of: Optional[Sequence[int]] = None, dispatch: str = "flat") -> ParallelGroups:
    """Create the groups on an initialised default process group (collective: all ranks call it).
    ``node_of``: the node of every rank (:func:`~moe_dist.distributed.topology.node_of_ranks`; None:
    one node). ``dispatch``: ``parallel.dispatch``, carried to the MoE layers."""
    if not (dist.is_available() and dist.is_initialized()):
        if ep_size != 1:
            raise ConfigError(f"parallel.ep={ep_size} needs torch.distributed to be initialised (world size 1 allows only ep=1)")
        return ParallelGroups(dispatch=dispatch)
    world, rank = dist.get_world_size(), dist.get_rank()
    describe_group(None)  # remember the default group's ranks while it exists
    if ep_size < 1 or world % ep_size:
        raise ConfigError(f"parallel.ep={ep_size} must be >= 1 and divide the world size {world}")
    if num_experts is not None and num_experts % ep_size:
        raise ConfigError(f"parallel.ep={ep_size} must divide model.moe.num_experts={num_experts}")
    ep_group = edp_group = None
    for start in range(0, world, ep_size):  # every rank must create every group, in the same order
        g = new_group(range(start, start + ep_size), name="ep")
        if start <= rank < start + ep_size:
            ep_group = g
    for off in range(ep_size):
        g = new_group(range(off, world, ep_size), name="edp")
        if rank % ep_size == off:
            edp_group = g
    start = rank - rank % ep_size
    if node_of is not None and len(node_of) != world:
        raise ValueError(f"node_of names {len(node_of)} ranks, the world has {world}")
    ep_nodes = NodeLayout(tuple(node_of[start:start + ep_size]) if node_of is not None else (0,) * ep_size)
    ep_node = ep_rail = None
    if dispatch == "hierarchical" and node_of is not None:
        ep_node, ep_rail = _node_and_rail_groups(world, ep_size, node_of, rank)
    return ParallelGroups(
        dp=dist.group.WORLD,
        ep=ep_group,
        edp=edp_group,
        ep_size=ep_size,
        ep_rank=rank % ep_size,
        dp_size=world,
        dp_rank=rank,
        edp_size=world // ep_size,
        ep_nodes=ep_nodes,
        dispatch=dispatch,
        ep_node=ep_node,
        ep_rail=ep_rail,
    )


def _node_and_rail_groups(world: int, ep_size: int, node_of: Sequence[int], rank: int) -> tuple:
    """The hierarchical dispatch's groups of every expert-parallel group that spans several nodes as
    blocks of equally many consecutive ranks: its ranks on each node, and its ranks in each position
    on every node (a rail). Collective: every rank makes every group, in the same order. Returns
    this rank's two (None, None where its ep group does not qualify)."""
    node_group = rail_group = None
    for start in range(0, world, ep_size):
        layout = NodeLayout(tuple(node_of[start:start + ep_size]))
        if not layout.node_blocks():
            continue
        nodes = [[start + p for p in layout.peers_on(n)] for n in range(layout.num_nodes)]
        for members in nodes:
            g = new_group(members, name="ep_node")
            if rank in members:
                node_group = g
        for j in range(len(nodes[0])):
            members = [ranks[j] for ranks in nodes]
            g = new_group(members, name="ep_rail")
            if rank in members:
                rail_group = g
    return node_group, rail_group
