"""Every cluster records itself in :data:`~.host.STATE_DIR` (owner pid, names, iptables rule), so that
what a crashed run left behind is found and removed (:func:`remove_stale`, ``down --all``)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from typing import Optional, Sequence

from .host import PREFIX, STATE_DIR, alive, list_netns, netns_pids, run, state_path


def remove(prefix: str, netns: Sequence[str], bridge: str, iptables_rule: Optional[list[str]]) -> None:
    """Kill every process on the namespaces, then remove them, their hosts files, the bridge, the
    iptables rule and the record; anything already gone is skipped."""
    for ns in netns:
        for _ in range(50):  # a namespace stays alive while a process runs in it
            pids = netns_pids(ns)
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        run(["ip", "netns", "del", ns], check=False)  # takes the node's veth pair with it
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    try:
        os.rmdir("/etc/netns")  # only when nothing else lives there
    except OSError:
        pass
    run(["ip", "link", "del", bridge], check=False)
    if iptables_rule:
        run(["iptables", "-D", *iptables_rule], check=False)
    try:
        os.unlink(state_path(prefix))
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
        if owner is not None and not alive(owner):
            remove(st["prefix"], st.get("netns", []), st.get("bridge", st["prefix"] + "-br"), st.get("iptables_rule"))
            gone.append(st["prefix"])
    return gone


def remove_all() -> list[str]:
    """Remove every cluster of this module on the machine, recorded or not (namespaces and links named PREFIX*)."""
    removed = []
    for st in recorded_clusters():
        remove(st["prefix"], st.get("netns", []), st.get("bridge", st["prefix"] + "-br"), st.get("iptables_rule"))
        removed.append(st["prefix"])
    for ns in list_netns():
        if ns.startswith(PREFIX):
            remove(ns.rsplit("-node", 1)[0], [ns], "", None)
    links = run(["ip", "-o", "link", "show"], check=False).stdout
    for name in re.findall(r"^\d+: ([^:@\s]+)", links, re.M):
        if name.startswith(PREFIX):
            run(["ip", "link", "del", name], check=False)
    rules = run(["iptables", "-S", "FORWARD"], check=False).stdout if shutil.which("iptables") else ""
    for line in rules.splitlines():
        m = re.match(rf"-A (FORWARD -i ({PREFIX}\S*-br) -o \2 -j ACCEPT)$", line)
        if m:
            run(["iptables", "-D", *m.group(1).split()], check=False)
    return removed
