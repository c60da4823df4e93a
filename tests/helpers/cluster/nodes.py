"""The nodes themselves: :class:`Cluster` makes the bridge, the namespaces and their links, runs commands
on a node, unplugs it or kills its processes, and removes everything again (see the package docstring)."""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from . import host
from .host import DEFAULT_SUBNET, IFNAME, PREFIX, SECOND_IFNAME, SECOND_SUBNET, STATE_DIR, node_command, unavailable_reason
from .state import remove

_RATE = re.compile(r"^\d+(\.\d+)?([kmg]?bit|[kmg]?bps)$")


class ClusterUnavailable(RuntimeError):
    """This machine cannot host a namespace cluster; the message says why (tests skip with it)."""


@dataclass
class Node:
    index: int
    hostname: str  # node0, node1, ...: its host name, and its name in every node's hosts file
    netns: str  # <prefix>-node0
    address: str  # 10.213.27.1
    veth: str  # the root-namespace end of its link, on the bridge


@dataclass
class Cluster:
    """``n`` nodes on one bridge; ``tag`` makes the names unique ("" for the command line's cluster)."""

    n: int
    rate: Optional[str] = None
    tag: Optional[str] = None  # None: a random one, so that clusters of concurrent runs never collide
    subnet: str = DEFAULT_SUBNET
    persistent: bool = False  # True: outlives this process (the command line's `up`)
    nodes: list[Node] = field(default_factory=list, init=False)
    iptables_rule: Optional[list[str]] = field(default=None, init=False)  # the ACCEPT rule inserted for the bridge

    def __post_init__(self):
        if not 1 <= self.n <= 200:
            raise ValueError(f"a cluster has 1 to 200 nodes, not {self.n}")
        if self.rate is not None and not _RATE.match(self.rate):
            raise ValueError(f"rate {self.rate!r} is not a tc rate such as 500mbit or 1gbit")
        if self.tag is None:
            self.tag = secrets.token_hex(2)
        self.prefix = PREFIX + self.tag
        self.bridge = f"{self.prefix}-br"
        self.nodes = [Node(i, f"node{i}", f"{self.prefix}-node{i}", f"{self.subnet}.{i + 1}", f"{self.prefix}-v{i}")
                      for i in range(self.n)]
        if any(len(name) > 15 for name in [self.bridge] + [nd.veth for nd in self.nodes]):
            raise ValueError(f"tag {self.tag!r} is too long for interface names (15 characters)")

    # ---- life cycle ----
    def __enter__(self) -> "Cluster":
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def node(self, name: str) -> Node:
        for nd in self.nodes:
            if name in (nd.hostname, nd.netns, str(nd.index)):
                return nd
        raise KeyError(f"no node {name!r} in this cluster (nodes: {', '.join(nd.hostname for nd in self.nodes)})")

    def up(self) -> None:
        """Create bridge, namespaces, links, addresses, hosts files (and the iptables rule); on any
        failure, remove what was made and raise."""
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        if os.path.exists(host.state_path(self.prefix)) or host.exists_netns(self.nodes[0].netns):
            raise ClusterUnavailable(f"a cluster named {self.prefix} exists already; remove it with "
                                     f"`scripts/cluster.sh down{' --tag ' + self.tag if self.tag else ''}`")
        self._save_state()  # first, so that a crash half-way leaves something `down --all` can find
        try:
            host.ip("link", "add", self.bridge, "type", "bridge")
            host.no_ipv6(self.bridge)
            host.ip("link", "set", self.bridge, "up")
            hosts = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n" + "".join(
                f"{nd.address}\t{nd.hostname}\n" for nd in self.nodes)
            for nd in self.nodes:
                self._add_node(nd, hosts)
            self.allow_forwarding()
            self._save_state()
            self._check_links()
        except BaseException:
            self.down()
            raise

    def allow_forwarding(self) -> None:
        """(Again) let the bridge's traffic through iptables' FORWARD chain: after an iptables or a
        dockerd that appeared while the cluster exists (dockerd sets the FORWARD policy to DROP)."""
        rule = host.allow_bridge(self.bridge)
        if rule and rule != self.iptables_rule:
            self.iptables_rule = rule
            self._save_state()

    def _check_links(self) -> None:
        """Every node reaches the first one by name over TCP; else ClusterUnavailable with the reason
        (a firewall between bridge ports, for example nftables rules that this module does not know)."""
        if self.n < 2:
            return
        port = 28999
        listen = ("import socket,sys; s=socket.create_server(('0.0.0.0',%d)); s.settimeout(20); print('up',flush=True)\n"
                  "for _ in range(%d): s.accept()[0].close()" % (port, self.n - 1))
        server = self.popen(self.nodes[0], [sys.executable, "-c", listen], stdout=subprocess.PIPE, text=True)
        try:
            if server.stdout.readline().strip() != "up":
                raise ClusterUnavailable("cannot start a listener on the first node of the cluster")
            connect = f"import socket; socket.create_connection(('{self.nodes[0].hostname}', {port}), timeout=10).close()"
            for nd in self.nodes[1:]:
                r = self.run(nd, [sys.executable, "-c", connect], timeout=30)
                if r.returncode:
                    raise ClusterUnavailable(
                        f"{nd.hostname} cannot reach {self.nodes[0].hostname} over the bridge {self.bridge} "
                        f"(a firewall between bridge ports? iptables / nft FORWARD rules): "
                        f"{(r.stderr.strip().splitlines() or ['exit code %d' % r.returncode])[-1]}")
        finally:
            server.kill()
            server.wait()

    def _add_node(self, nd: Node, hosts: str) -> None:
        host.ip("netns", "add", nd.netns)
        os.makedirs(f"/etc/netns/{nd.netns}", exist_ok=True)
        with open(f"/etc/netns/{nd.netns}/hosts", "w") as f:
            f.write(hosts)
        peer = f"{self.prefix}-p{nd.index}"
        host.ip("link", "add", nd.veth, "type", "veth", "peer", "name", peer)
        host.ip("link", "set", peer, "netns", nd.netns)
        host.no_ipv6(nd.veth)
        host.ip("link", "set", nd.veth, "master", self.bridge)
        host.ip("link", "set", nd.veth, "up")
        ns = ["-n", nd.netns]
        # IPv6 off on the node: no router/neighbour solicitations, so the link counts only our traffic
        host.run(["ip", "netns", "exec", nd.netns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
              "net.ipv6.conf.default.disable_ipv6=1"], check=False)
        host.ip(*ns, "link", "set", peer, "name", IFNAME)
        host.ip(*ns, "addr", "add", f"{nd.address}/24", "dev", IFNAME)
        host.ip(*ns, "link", "set", IFNAME, "up")
        host.ip(*ns, "link", "set", "lo", "up")
        if self.rate:
            for where in ([], ns):  # towards the node (bridge side) and from it
                dev = nd.veth if not where else IFNAME
                host.run(["tc", *where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "256kb",
                      "latency", "200ms"])

    def down(self) -> None:
        """Kill every process left on the nodes and remove namespaces, links, bridge, hosts files and
        the iptables rule; never raises for something already gone."""
        remove(self.prefix, [nd.netns for nd in self.nodes], self.bridge, self.iptables_rule)

    # ---- commands on a node ----
    def command(self, node: Node | str, argv: Sequence[str]) -> list[str]:
        """``argv`` as it runs on ``node``: in its network namespace (and hosts file), with its host name."""
        nd = node if isinstance(node, Node) else self.node(node)
        return node_command(nd.netns, nd.hostname, argv)

    def popen(self, node: Node | str, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
              **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.command(node, argv), env=dict(os.environ if env is None else env), **kwargs)

    def run(self, node: Node | str, argv: Sequence[str], env: Optional[Mapping[str, str]] = None,
            **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(node, argv), env=dict(os.environ if env is None else env), **kwargs)

    def pids(self, node: Node | str) -> list[int]:
        nd = node if isinstance(node, Node) else self.node(node)
        return host.netns_pids(nd.netns)

    def kill_node(self, node: Node | str, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process on ``node`` (as if the machine died); returns their pids."""
        pids = self.pids(node)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def set_link(self, node: Node | str, up: bool) -> None:
        """Unplug (or plug back) ``node``'s cable: its bridge-side end goes down, so nothing it sends
        arrives and nothing reaches it, and no peer sees a connection reset."""
        nd = node if isinstance(node, Node) else self.node(node)
        host.ip("link", "set", nd.veth, "up" if up else "down")

    def add_second_interface(self, node: Node | str, subnet: str = SECOND_SUBNET) -> str:
        """Give ``node`` a second interface, ``eth1`` (``SUBNET.(I+1)/24``), that holds its default route
        and to which its own host name resolves on the node itself (the other nodes still resolve it to
        its ``eth0`` address): a host whose default interface cannot reach the other nodes. ``eth1`` is
        one end of a veth pair whose other end, also inside the node, has no address, so what the node
        sends through it goes nowhere (not even to the root namespace); the node gets a resolv.conf
        without name servers. Returns the address; removed with the node."""
        nd = node if isinstance(node, Node) else self.node(node)
        address, ns = f"{subnet}.{nd.index + 1}", ["-n", nd.netns]
        host.ip(*ns, "link", "add", SECOND_IFNAME, "type", "veth", "peer", "name", SECOND_IFNAME + "-end")
        host.ip(*ns, "addr", "add", f"{address}/24", "dev", SECOND_IFNAME)
        for dev in (SECOND_IFNAME + "-end", SECOND_IFNAME):
            host.ip(*ns, "link", "set", dev, "up")
        host.ip(*ns, "route", "add", "default", "dev", SECOND_IFNAME)
        hosts = f"/etc/netns/{nd.netns}/hosts"
        with open(hosts) as f:
            lines = [line for line in f if line.split()[1:] != [nd.hostname]]
        with open(hosts, "w") as f:
            f.write("".join(lines) + f"{address}\t{nd.hostname}\n")
        # no name server (the resolver then asks 127.0.0.1, which refuses at once): a look-up of a name or
        # address that no hosts file knows (torch asks for its peers' names) fails at once instead of
        # waiting for an answer from the route that leads nowhere
        with open(f"/etc/netns/{nd.netns}/resolv.conf", "w") as f:
            f.write(f"# {nd.hostname}: names come from its hosts file only\n")
        return address

    def link_bytes(self, node: Node | str) -> tuple[int, int]:
        """(received, sent) bytes on ``node``'s eth0, read inside its namespace."""
        nd = node if isinstance(node, Node) else self.node(node)
        out = host.run(["ip", "netns", "exec", nd.netns, "cat", f"/sys/class/net/{IFNAME}/statistics/rx_bytes",
                    f"/sys/class/net/{IFNAME}/statistics/tx_bytes"]).stdout.split()
        return int(out[0]), int(out[1])

    # ---- state ----
    def _save_state(self) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        state = {"prefix": self.prefix, "tag": self.tag, "owner": None if self.persistent else os.getpid(),
                 "bridge": self.bridge, "netns": [nd.netns for nd in self.nodes], "rate": self.rate,
                 "nodes": [nd.__dict__ for nd in self.nodes], "iptables_rule": self.iptables_rule}
        with open(host.state_path(self.prefix), "w") as f:
            json.dump(state, f, indent=1)
