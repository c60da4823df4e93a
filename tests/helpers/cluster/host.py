"""The machine side of a namespace cluster: names, addresses, what this machine allows, and the
``ip`` / ``iptables`` / process primitives the nodes, the records and the command line share."""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Optional, Sequence

PREFIX = "mdn"  # every namespace, interface, bridge and state file of these clusters starts with it
STATE_DIR = "/run/moe-dist-cluster"
DEFAULT_SUBNET = "10.213.27"  # node I is DEFAULT_SUBNET.(I+1); only ever inside the namespaces
IFNAME = "eth0"  # a node's interface, inside its namespace
SECOND_IFNAME = "eth1"  # a node's optional second interface (Cluster.add_second_interface), its default route
SECOND_SUBNET = "10.213.2"  # its addresses: SECOND_SUBNET.(I+1), reachable from nowhere (below the eth0 subnet: see docs/namespace-cluster.md)


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
    r = run(["ip", "netns", "add", probe], check=False)
    if r.returncode:
        return f"`ip netns add` does not work here: {r.stderr.strip() or r.returncode}"
    try:
        r = run(["ip", "netns", "exec", probe, "unshare", "--uts", "--", "hostname", "probe"], check=False)
        if r.returncode:
            return f"`unshare --uts` does not work inside a network namespace here: {r.stderr.strip() or r.returncode}"
    finally:
        run(["ip", "netns", "del", probe], check=False)
    br = f"{PREFIX}probe-br"
    r = run(["ip", "link", "add", br, "type", "bridge"], check=False)
    if r.returncode and "File exists" not in r.stderr:
        return f"cannot create a bridge here: {r.stderr.strip() or r.returncode}"
    run(["ip", "link", "del", br], check=False)
    return None


# ---- small helpers ----
def state_path(prefix: str) -> str:
    return os.path.join(STATE_DIR, f"{prefix}.json")


def allow_bridge(bridge: str) -> Optional[list[str]]:
    """Let the bridge's own traffic through the FORWARD chain (idempotent); the rule, or None without
    iptables. Inserted whatever the policy is now: a dockerd started later sets it to DROP."""
    if shutil.which("iptables") is None:
        return None
    rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
    if run(["iptables", "-S", "FORWARD"], check=False).returncode:  # no usable iptables (no netfilter tables)
        return None
    if run(["iptables", "-C", *rule], check=False).returncode:
        run(["iptables", "-I", *rule])
    return rule


def no_ipv6(dev: str) -> None:
    """No IPv6 on one of our root-namespace interfaces (no solicitations on the nodes' links)."""
    try:
        with open(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6", "w") as f:
            f.write("1")
    except OSError:  # no IPv6 on this kernel: nothing to silence
        pass


def run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    if check and r.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r


def ip(*args: str) -> None:
    run(["ip", *args])


def list_netns() -> list[str]:
    out = run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def exists_netns(name: str) -> bool:
    return name in list_netns()


def netns_pids(netns: str) -> list[int]:
    r = run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
