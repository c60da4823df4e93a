"""Which ranks share a node: the node of every rank, and of every expert-parallel peer.

A node is a set of ranks that talk to each other without crossing the inter-node network (one
host, or one NVLink domain). By default the nodes are the ranks' host names (every rank's name is
gathered once at start-up, :func:`moe_dist.distributed.roll_call.remember_hosts`); ``parallel.ranks_per_node``
declares them instead as blocks of consecutive ranks (a host whose ranks should count as several
nodes, or several nodes on one machine in a test).

    nodes = node_of_ranks(hosts())                 # ["a", "a", "b", "b"] -> (0, 0, 1, 1)
    layout = NodeLayout(nodes[0:4])                # an ep group's peers, in group rank order
    layout.num_nodes, layout.node_of[2], layout.peers_on(1)   # 2, 1, (2, 3)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ..errors import ConfigError


def node_of_ranks(hosts: Sequence[str], ranks_per_node: Optional[int] = None) -> tuple[int, ...]:
    """The node index of every rank (in rank order). Nodes are numbered in the order their first rank
    appears: by host name, or, with ``ranks_per_node``, as blocks of that many consecutive ranks."""
    world = len(hosts)
    if ranks_per_node is not None:
        if ranks_per_node < 1 or world % ranks_per_node:
            raise ConfigError(f"parallel.ranks_per_node={ranks_per_node} must be >= 1 and divide the world size {world}")
        return tuple(r // ranks_per_node for r in range(world))
    index: dict[str, int] = {}
    return tuple(index.setdefault(h, len(index)) for h in hosts)


@dataclass(frozen=True)
class NodeLayout:
    """The nodes of a group's ranks: ``node_of[i]`` is the node of the group's rank ``i``, nodes
    renumbered 0.. in the order they first appear in the group."""

    node_of: tuple[int, ...] = (0,)

    def __post_init__(self):
        index: dict[int, int] = {}
        object.__setattr__(self, "node_of", tuple(index.setdefault(n, len(index)) for n in self.node_of))

    @property
    def size(self) -> int:
        return len(self.node_of)

    @property
    def num_nodes(self) -> int:
        return max(self.node_of) + 1

    @property
    def multi_node(self) -> bool:
        return self.num_nodes > 1

    def peers_on(self, node: int) -> tuple[int, ...]:
        """The group ranks on ``node``, in group rank order."""
        return tuple(r for r, n in enumerate(self.node_of) if n == node)

    def local_index(self, rank: int) -> int:
        """``rank``'s position among the group ranks of its node."""
        return self.peers_on(self.node_of[rank]).index(rank)

    def contiguous(self) -> bool:
        """Every node's ranks are consecutive in the group (the expert-parallel layouts this project
        builds: ranks are placed node by node)."""
        return all(self.node_of[r] <= self.node_of[r + 1] for r in range(self.size - 1))

    def uniform(self) -> bool:
        """Every node holds the same number of the group's ranks."""
        return len({len(self.peers_on(n)) for n in range(self.num_nodes)}) == 1

    def node_blocks(self) -> bool:
        """The group spans several nodes as equal blocks of consecutive ranks: the layout on which
        the hierarchical dispatch runs (its node and rail groups are made) and an expert group of
        node-limited routing can be one node's experts."""
        return self.multi_node and self.contiguous() and self.uniform()


SINGLE = NodeLayout()
