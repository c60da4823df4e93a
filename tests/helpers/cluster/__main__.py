"""The command line of a namespace cluster (``scripts/cluster.sh`` wraps it): up, exec, status, down."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from .host import DEFAULT_SUBNET, PREFIX, alive
from .nodes import Cluster, ClusterUnavailable
from .state import recorded_clusters, remove_all


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
                "" if alive(st["owner"]) else " (dead: stale)")
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
