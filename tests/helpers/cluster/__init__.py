"""Several "nodes" on one machine: network namespaces on one bridge, each with its own address and name.

Test infrastructure, not part of the installed package: used by the multi-node tests (as
``helpers.cluster``), ``scripts/cluster.sh`` and the cluster benchmarks (``benchmarks.plan_time_check``,
``node_dispatch_bench``, ``hierarchical_bytes``, as ``tests.helpers.cluster`` from the repository root);
never imported by the trainer or the launchers. Needs root and ``ip netns``. The pieces:
:mod:`.host` (names, what the machine allows, the ``ip`` primitives), :mod:`.nodes` (:class:`Cluster`),
:mod:`.state` (the records and the clean-up of crashed runs), :mod:`.__main__` (the command line).

    with Cluster(2, rate="500mbit") as c:          # needs root and `ip netns`
        c.run(c.nodes[0], ["hostname"])             # -> node0
        p = c.popen(c.nodes[1], ["python", "-c", "..."], env=env)
        c.link_bytes(c.nodes[0])                    # (rx, tx) of node0's eth0
    c.add_second_interface(c.nodes[1])          # node1: eth1 holds its default route and its own name
    # everything is removed again, also after an exception

Every node is a network namespace ``<prefix>-nodeI`` with one interface, ``eth0``: one end of a
veth pair whose other end sits on the bridge ``<prefix>-br`` in the root namespace. The nodes get
addresses ``SUBNET.(I+1)/24`` of a private range that exists only inside these namespaces: the
bridge has no address, no namespace has a default route, so nothing a node sends can leave the
machine, and the root namespace cannot reach the nodes either. Each node resolves every node's
name through its own hosts file (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` mounts over
``/etc/hosts``) and runs its commands in a UTS namespace of their own with the node's host name
(torch's c10d rendezvous and gloo resolve the machine's own host name, so it must be the node's).
Ranks on one node talk over that node's loopback; ranks on different nodes only over the veth,
whose byte counters therefore show the inter-node traffic. ``rate`` puts a ``tc tbf`` limit on
both directions of every node's link. Where iptables exists, a rule lets the bridge's own traffic
through the FORWARD chain while the cluster exists: once ``dockerd`` has run, its policy is DROP
with bridge netfilter on, and bridged traffic between the nodes would be dropped
(:meth:`Cluster.allow_forwarding` inserts it again if iptables appeared later).

The names all start with :data:`PREFIX`, and every cluster records itself in
:data:`STATE_DIR` (owner pid, names, iptables rule), so that :func:`remove_stale` and the command
line's ``down --all`` clean up what a crashed run left behind.

Command line (``scripts/cluster.sh`` wraps it)::

    python -m tests.helpers.cluster up 2 [--rate 500mbit]    # nodes node0, node1 (namespaces mdn-node0, ...)
    python -m tests.helpers.cluster exec node1 -- CMD ...     # CMD on node1 (its netns and host name)
    python -m tests.helpers.cluster status
    python -m tests.helpers.cluster down [--all]
"""
from .host import DEFAULT_SUBNET, IFNAME, PREFIX, SECOND_IFNAME, SECOND_SUBNET, STATE_DIR, node_command, unavailable_reason
from .nodes import Cluster, ClusterUnavailable, Node
from .state import recorded_clusters, remove_all, remove_stale

__all__ = ["Cluster", "ClusterUnavailable", "Node", "node_command", "unavailable_reason", "recorded_clusters",
           "remove_all", "remove_stale", "PREFIX", "STATE_DIR", "DEFAULT_SUBNET", "IFNAME", "SECOND_IFNAME",
           "SECOND_SUBNET"]
