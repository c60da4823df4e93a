"""Which node is gone after a collective failed: a roll call through the job's rendezvous store.

A collective that lost its peer or timed out says neither which rank nor which machine is
missing. At start-up every rank learns every rank's host name (:func:`remember_hosts`, one
small all-gather) and the address of the job's rendezvous store (``tcp://MASTER_ADDR:MASTER_PORT``,
on the first node). After a failure each surviving rank connects to that store anew, with a
timeout of its own, writes its name there and waits a short while for the others'
(:func:`roll_call`); the hosts none of whose ranks answered are the lost nodes. A rank that
cannot reach the store at all is itself cut off from the job (or the store's node is gone),
and says so.

    remember_hosts("node0", 29500)         # every rank, once the default group exists
    ...
    lost_nodes_line(wait_s=10)             # after a failed collective: "node1 (ranks 2, 3) ..."
"""
from __future__ import annotations

import datetime
import os
import re
import socket
import time
from typing import Optional

import torch.distributed as dist

from ..quiet import native_stderr_silenced

_KEY = "moe_dist/roll_call"
_hosts: list[str] = []  # host name of every rank, by rank
_store_at: Optional[tuple[str, int]] = None  # the rendezvous store's (host, port)
_rank = 0
_attempt: Optional[str] = None  # rank 0's torchrun restart count (remember_hosts)


def remember_hosts(store_host: Optional[str], store_port: Optional[int]) -> None:
    """Collective: record every rank's host name and where the job's TCP store listens (None: the
    group was not made from a TCP address; no roll call then). No-op on one process."""
    global _hosts, _store_at, _rank, _attempt
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    names: list[Optional[tuple[str, str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(names, (socket.gethostname(), _restart_count()))
    _hosts, _rank = [str(n[0]) for n in names], dist.get_rank()
    _attempt = str(names[0][1])  # rank 0's: a node that joined later counts its restarts from 0
    _store_at = (store_host, int(store_port)) if store_host and store_port else None


def hosts() -> list[str]:
    return list(_hosts)


def store_at() -> Optional[tuple[str, int]]:
    """The job's TCP store as (host, port), once recorded (None: not recorded, or no TCP store)."""
    return _store_at


def rank() -> int:
    return _rank


def _restart_count() -> str:
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def attempt() -> str:
    """This attempt of the job, the same on every rank: a torchrun restart may reuse the store, where
    answers and beats of an earlier attempt must not count. torchrun counts restarts per node, so a
    node that joined a running job counts differently: every rank takes rank 0's count."""
    return _attempt if _attempt is not None else _restart_count()


def roll_call(wait_s: float) -> Optional[set[int]]:
    """Answer, then wait up to ``wait_s`` seconds for every rank's answer; the ranks that answered,
    or None when the store cannot be reached (or was never recorded)."""
    if _store_at is None or not _hosts:
        return None
    prefix = f"{_KEY}/{attempt()}"
    try:
        # torch's store logs a failed connection with a C++ stack trace, which would bury the one
        # line this roll call is for
        with native_stderr_silenced():
            return _answer_and_wait(prefix, wait_s)
    except (RuntimeError, OSError):  # DistStoreError, a refused or timed-out connection
        return None


def _answer_and_wait(prefix: str, wait_s: float) -> set[int]:
    """Write this rank's answer, then collect the others' until all answered or ``wait_s`` passed."""
    # a connection of its own: the group's may be gone, and its timeout is the long collective one
    store = dist.TCPStore(_store_at[0], _store_at[1], is_master=False,
                          timeout=datetime.timedelta(seconds=max(1.0, wait_s)))
    store.set(f"{prefix}/{_rank}", socket.gethostname())
    answered, deadline = {_rank}, time.monotonic() + wait_s
    while True:
        for r in range(len(_hosts)):
            if r not in answered and store.check([f"{prefix}/{r}"]):
                answered.add(r)
        if len(answered) == len(_hosts) or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    store.set(f"{prefix}/done/{_rank}", "1")
    if _rank == 0:
        _hold_store(store, prefix, answered, wait_s)
    return answered


def _hold_store(store, prefix: str, answered: set[int], wait_s: float) -> None:
    """Rank 0's process holds the store where no launcher agent does (srun, mpirun): before it ends, it
    waits (up to twice ``wait_s``) until every rank on a node that answered has finished its own roll
    call. A rank whose collective failed later than rank 0's would otherwise find the store gone and
    call its own node cut off."""
    live = {_hosts[r] for r in answered}
    others = [r for r, h in enumerate(_hosts) if h in live and r != _rank]
    deadline = time.monotonic() + 2 * wait_s
    while others and time.monotonic() < deadline:
        others = [r for r in others if not store.check([f"{prefix}/done/{r}"])]
        time.sleep(0.2)


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def lost_nodes_line(wait_s: float) -> str:
    """A clause naming the lost node(s) and their ranks after a roll call of ``wait_s`` seconds, or
    why none can be named; "" when the job runs on one host (its launcher names a dead rank), or
    without a recorded store (before :func:`remember_hosts`, or a group made by someone else)."""
    if len(set(_hosts)) < 2 or _store_at is None:
        return ""
    me = _hosts[_rank] if _rank < len(_hosts) else socket.gethostname()
    answered = roll_call(wait_s)
    if answered is None:
        host, port = _store_at
        return f"the job's rendezvous store at {host}:{port} cannot be reached either: {cut_off(me)}"
    by_host = _by_host(_hosts)
    lost = [h for h, ranks in by_host.items() if not answered & set(ranks)]
    silent = sorted(set(range(len(_hosts))) - answered)
    if lost:
        names = "; ".join(f"node {h} ({_ranks(by_host[h])})" for h in lost)
        whose = "its" if len(lost) == 1 else "their"
        return f"lost {names}: none of {whose} ranks answered a roll call within {wait_s:g} s"
    if silent:
        return f"{_ranks(silent)} did not answer a roll call within {wait_s:g} s (every node has ranks that did)"
    return "every rank answered a roll call: no node is lost"


def cut_off(me: str) -> str:
    """What a rank that cannot reach the job's store concludes (``me``: its host)."""
    return f"this node ({me}) is cut off from the others, or {_store_at[0] if _store_at else 'the store'} is lost"


def _by_host(hosts: list[str]) -> dict[str, list[int]]:
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    return by_host


def name_ranks(hosts: list[str], missing: list[int]) -> str:
    """``missing`` ranks of a job whose ranks run on ``hosts`` (host name by rank), by node: "node
    node1 (ranks 2, 3)" for a node all of whose ranks are missing, the others as ranks ("rank 2 on
    node0" when the job runs on one host)."""
    by_host, gone = _by_host(hosts), set(missing)
    whole = [h for h, ranks in by_host.items() if set(ranks) <= gone] if len(by_host) > 1 else []
    parts = [f"node {h} ({_ranks(by_host[h])})" for h in whole]
    rest = sorted(gone - {r for h in whole for r in by_host[h]})
    if rest:
        parts.append(_ranks(rest) + (f" on {hosts[rest[0]]}" if len(by_host) == 1 else ""))
    return "; ".join(parts)


_WHOLE_NODE = re.compile(r"\bnode (\S+) \(ranks? \d")


def named_nodes(line: str) -> list[str]:
    """The nodes a line of :func:`lost_nodes_line` or :func:`name_ranks` names as lost (all of their
    ranks gone), in order: what a launcher reads from a rank's report to go on without them."""
    return list(dict.fromkeys(_WHOLE_NODE.findall(line)))


def roll_call_wait(timeout_s: Optional[float]) -> float:
    """How long survivors wait for each other's answers: a tenth of the collective timeout, 2 to 10 s."""
    return min(10.0, max(2.0, (timeout_s or 100.0) / 10))
