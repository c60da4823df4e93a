"""Several "nodes" on one machine: network namespaces on one bridge, each with its own address and name.

Test infrastructure (see :mod:`moe_dist.testing`): used by the multi-node tests, ``scripts/cluster.sh``
and the cluster benchmarks of :mod:`moe_dist.bench`; never imported by the trainer or the launchers.

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

    python -m moe_dist.testing.cluster up 2 [--rate 500mbit]    # nodes node0, node1 (namespaces mdn-node0, ...)
    python -m moe_dist.testing.cluster exec node1 -- CMD ...     # CMD on node1 (its netns and host name)
    python -m moe_dist.testing.cluster status
    python -m moe_dist.testing.cluster down [--all]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

PREFIX = "mdn"  # every namespace, interface, bridge and state file of these clusters starts with it
STATE_DIR = "/run/moe-dist-cluster"
DEFAULT_SUBNET = "10.213.27"  # node I is DEFAULT_SUBNET.(I+1); only ever inside the namespaces
IFNAME = "eth0"  # a node's interface, inside its namespace
SECOND_IFNAME = "eth1"  # a node's optional second interface (Cluster.add_second_interface), its default route
SECOND_SUBNET = "10.213.2"  # its addresses: SECOND_SUBNET.(I+1), reachable from nowhere (below the eth0 subnet: see docs/namespace-cluster.md)
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
        if os.path.exists(_state_path(self.prefix)) or _exists_netns(self.nodes[0].netns):
            raise ClusterUnavailable(f"a cluster named {self.prefix} exists already; remove it with "
                                     f"`scripts/cluster.sh down{' --tag ' + self.tag if self.tag else ''}`")
        self._save_state()  # first, so that a crash half-way leaves something `down --all` can find
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _no_ipv6(self.bridge)
            _ip("link", "set", self.bridge, "up")
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
        rule = _allow_bridge(self.bridge)
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
        _ip("netns", "add", nd.netns)
        os.makedirs(f"/etc/netns/{nd.netns}", exist_ok=True)
        with open(f"/etc/netns/{nd.netns}/hosts", "w") as f:
            f.write(hosts)
        peer = f"{self.prefix}-p{nd.index}"
        _ip("link", "add", nd.veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", nd.netns)
        _no_ipv6(nd.veth)
        _ip("link", "set", nd.veth, "master", self.bridge)
        _ip("link", "set", nd.veth, "up")
        ns = ["-n", nd.netns]
        # IPv6 off on the node: no router/neighbour solicitations, so the link counts only our traffic
        _run(["ip", "netns", "exec", nd.netns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1",
              "net.ipv6.conf.default.disable_ipv6=1"], check=False)
        _ip(*ns, "link", "set", peer, "name", IFNAME)
        _ip(*ns, "addr", "add", f"{nd.address}/24", "dev", IFNAME)
        _ip(*ns, "link", "set", IFNAME, "up")
        _ip(*ns, "link", "set", "lo", "up")
        if self.rate:
            for where in ([], ns):  # towards the node (bridge side) and from it
                dev = nd.veth if not where else IFNAME
                _run(["tc", *where, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "256kb",
                      "latency", "200ms"])

    def down(self) -> None:
        """Kill every process left on the nodes and remove namespaces, links, bridge, hosts files and
        the iptables rule; never raises for something already gone."""
        _remove(self.prefix, [nd.netns for nd in self.nodes], self.bridge, self.iptables_rule)

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
        return _netns_pids(nd.netns)

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
        _ip("link", "set", nd.veth, "up" if up else "down")

    def add_second_interface(self, node: Node | str, subnet: str = SECOND_SUBNET) -> str:
        """Give ``node`` a second interface, ``eth1`` (``SUBNET.(I+1)/24``), that holds its default route
        and to which its own host name resolves on the node itself (the other nodes still resolve it to
        its ``eth0`` address): a host whose default interface cannot reach the other nodes. ``eth1`` is
        one end of a veth pair whose other end, also inside the node, has no address, so what the node
        sends through it goes nowhere (not even to the root namespace); the node gets a resolv.conf
        without name servers. Returns the address; removed with the node."""
        nd = node if isinstance(node, Node) else self.node(node)
        address, ns = f"{subnet}.{nd.index + 1}", ["-n", nd.netns]
        _ip(*ns, "link", "add", SECOND_IFNAME, "type", "veth", "peer", "name", SECOND_IFNAME + "-end")
        _ip(*ns, "addr", "add", f"{address}/24", "dev", SECOND_IFNAME)
        for dev in (SECOND_IFNAME + "-end", SECOND_IFNAME):
            _ip(*ns, "link", "set", dev, "up")
        _ip(*ns, "route", "add", "default", "dev", SECOND_IFNAME)
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
        out = _run(["ip", "netns", "exec", nd.netns, "cat", f"/sys/class/net/{IFNAME}/statistics/rx_bytes",
                    f"/sys/class/net/{IFNAME}/statistics/tx_bytes"]).stdout.split()
        return int(out[0]), int(out[1])

    # ---- state ----
    def _save_state(self) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        state = {"prefix": self.prefix, "tag": self.tag, "owner": None if self.persistent else os.getpid(),
                 "bridge": self.bridge, "netns": [nd.netns for nd in self.nodes], "rate": self.rate,
                 "nodes": [nd.__dict__ for nd in self.nodes], "iptables_rule": self.iptables_rule}
        with open(_state_path(self.prefix), "w") as f:
            json.dump(state, f, indent=1)


def node_command(netns: str, hostname: str, argv: Sequence[str]) -> list[str]:
    # `ip netns exec` enters the namespace and mounts its hosts file; `unshare --uts` gives the
    # command (and all it starts) a host name of its own without touching the machine's
    return ["ip", "netns", "exec", netns, "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"',
            hostname, *argv]


# ---- what the machine allows ----
def unavailable_reason() -> Optional[str]:
    """None when namespace clusters can be made here, else the reason (one line)."""
    if os.geteuid() != 0:
        return "a namespace cluster needs root (ip netns, veth, bridge)"
    for tool in ("ip", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"a namespace cluster needs `{tool}`, which is not installed (iproute2 / util-linux)"
    probe = f"{PREFIX}probe{os.getpid() % 100000}"
    r = _run(["ip", "netns", "add", probe], check=False)
    if r.returncode:
        return f"`ip netns add` does not work here: {r.stderr.strip() or r.returncode}"
    try:
        r = _run(["ip", "netns", "exec", probe, "unshare", "--uts", "--", "hostname", "probe"], check=False)
        if r.returncode:
            return f"`unshare --uts` does not work inside a network namespace here: {r.stderr.strip() or r.returncode}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    br = f"{PREFIX}probe-br"
    r = _run(["ip", "link", "add", br, "type", "bridge"], check=False)
    if r.returncode and "File exists" not in r.stderr:
        return f"cannot create a bridge here: {r.stderr.strip() or r.returncode}"
    _run(["ip", "link", "del", br], check=False)
    return None


# ---- removal ----
def _remove(prefix: str, netns: Sequence[str], bridge: str, iptables_rule: Optional[list[str]]) -> None:
    for ns in netns:
        for _ in range(50):  # a namespace stays alive while a process runs in it
            pids = _netns_pids(ns)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        _run(["ip", "netns", "del", ns], check=False)  # takes the node's veth pair with it
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    try:
        os.rmdir("/etc/netns")  # only when nothing else lives there
    except OSError:
        pass
    _run(["ip", "link", "del", bridge], check=False)
    if iptables_rule:
        _run(["iptables", "-D", *iptables_rule], check=False)
    try:
        os.unlink(_state_path(prefix))
    except FileNotFoundError:
        pass


def recorded_clusters() -> list[dict]:
    out = []
    if os.path.isdir(STATE_DIR):
        for name in sorted(os.listdir(STATE_DIR)):
            if name.startswith(PREFIX) and name.endswith(".json"):
                try:
                    with open(os.path.join(STATE_DIR, name)) as f:
                        out.append(json.load(f))
                except (OSError, ValueError):
                    out.append({"prefix": name[:-5], "owner": None, "netns": [], "bridge": name[:-5] + "-br"})
    return out


def remove_stale() -> list[str]:
    """Remove the clusters whose owner process has ended (a crashed or killed test run); returns their prefixes."""
    gone = []
    for st in recorded_clusters():
        owner = st.get("owner")
        if owner is not None and not _alive(owner):
            _remove(st["prefix"], st.get("netns", []), st.get("bridge", st["prefix"] + "-br"), st.get("iptables_rule"))
            gone.append(st["prefix"])
    return gone


def remove_all() -> list[str]:
    """Remove every cluster of this module on the machine, recorded or not (namespaces and links named PREFIX*)."""
    removed = []
    for st in recorded_clusters():
        _remove(st["prefix"], st.get("netns", []), st.get("bridge", st["prefix"] + "-br"), st.get("iptables_rule"))
        removed.append(st["prefix"])
    for ns in _list_netns():
        if ns.startswith(PREFIX):
            _remove(ns.rsplit("-node", 1)[0], [ns], "", None)
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    for name in re.findall(r"^\d+: ([^:@\s]+)", links, re.M):
        if name.startswith(PREFIX):
            _run(["ip", "link", "del", name], check=False)
    rules = _run(["iptables", "-S", "FORWARD"], check=False).stdout if shutil.which("iptables") else ""
    for line in rules.splitlines():
        m = re.match(rf"-A (FORWARD -i ({PREFIX}\S*-br) -o \2 -j ACCEPT)$", line)
        if m:
            _run(["iptables", "-D", *m.group(1).split()], check=False)
    return removed


# ---- small helpers ----
def _state_path(prefix: str) -> str:
    return os.path.join(STATE_DIR, f"{prefix}.json")


def _allow_bridge(bridge: str) -> Optional[list[str]]:
    """Let the bridge's own traffic through the FORWARD chain (idempotent); the rule, or None without
    iptables. Inserted whatever the policy is now: a dockerd started later sets it to DROP."""
    if shutil.which("iptables") is None:
        return None
    rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
    if _run(["iptables", "-S", "FORWARD"], check=False).returncode:  # no usable iptables (no netfilter tables)
        return None
    if _run(["iptables", "-C", *rule], check=False).returncode:
        _run(["iptables", "-I", *rule])
    return rule


def _no_ipv6(dev: str) -> None:
    """No IPv6 on one of our root-namespace interfaces (no solicitations on the nodes' links)."""
    try:
        with open(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6", "w") as f:
            f.write("1")
    except OSError:  # no IPv6 on this kernel: nothing to silence
        pass


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    if check and r.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _list_netns() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _exists_netns(name: str) -> bool:
    return name in _list_netns()


def _netns_pids(netns: str) -> list[int]:
    r = _run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- command line ----
def _cli_cluster(tag: str) -> Optional[Cluster]:
    """The recorded cluster of this tag, or None."""
    for st in recorded_clusters():
        if st["prefix"] == PREFIX + tag:
            c = Cluster(len(st["nodes"]), rate=st.get("rate"), tag=tag, subnet=st["nodes"][0]["address"].rsplit(".", 1)[0],
                        persistent=True)
            c.iptables_rule = st.get("iptables_rule")
            return c
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="cluster", description="Nodes as network namespaces on one machine (root).")
    p.add_argument("--tag", default="", help=f"names start with {PREFIX}TAG (default: {PREFIX}-node0, {PREFIX}-br, ...)")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="bring up N nodes")
    up.add_argument("n", type=int)
    up.add_argument("--rate", help="tc tbf rate limit on every node's link, e.g. 500mbit")
    up.add_argument("--subnet", default=DEFAULT_SUBNET, help=f"first three octets of the nodes' addresses ({DEFAULT_SUBNET})")
    down = sub.add_parser("down", help="remove the cluster")
    down.add_argument("--all", action="store_true", help=f"remove every {PREFIX}* cluster, also leftovers of crashed runs")
    ex = sub.add_parser("exec", help="run a command on a node: exec NODE -- CMD ...")
    ex.add_argument("node")
    ex.add_argument("argv", nargs=argparse.REMAINDER)
    sub.add_parser("status", help="list the clusters and their nodes")
    a = p.parse_args(argv)
    tag = a.tag
    if a.cmd == "up":
        c = Cluster(a.n, rate=a.rate, tag=tag, subnet=a.subnet, persistent=True)
        try:
            c.up()
        except (ClusterUnavailable, RuntimeError, ValueError) as e:
            print(f"cluster: {e}", file=sys.stderr)
            return 2
        for nd in c.nodes:
            print(f"{nd.hostname}\t{nd.address}\tnetns {nd.netns}")
        return 0
    if a.cmd == "down":
        if a.all:
            removed = remove_all()
        else:
            c = _cli_cluster(tag)
            if c is not None:
                c.down()
            removed = [c.prefix] if c is not None else []
        print("removed: " + (", ".join(removed) or "nothing"))
        return 0
    if a.cmd == "status":
        for st in recorded_clusters():
            owner = "persistent" if st.get("owner") is None else f"owner pid {st['owner']}" + (
                "" if _alive(st["owner"]) else " (dead: stale)")
            print(f"{st['prefix']}: {len(st.get('netns', []))} node(s), rate {st.get('rate') or 'unlimited'}, {owner}")
        return 0
    argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
    if not argv:
        p.error("exec NODE -- CMD: no command given")
    c = _cli_cluster(tag)
    if c is None:
        print(f"cluster: no cluster {PREFIX + tag} is up (scripts/cluster.sh up N)", file=sys.stderr)
        return 2
    try:
        cmd = c.command(a.node, argv)
    except KeyError as e:
        print(f"cluster: {e.args[0]}", file=sys.stderr)
        return 2
    os.execvp(cmd[0], cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
