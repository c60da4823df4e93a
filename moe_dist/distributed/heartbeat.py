"""A silent node noticed in seconds, whatever ``parallel.timeout_s``: heartbeats through the job's store.

A peer that is gone with its connections still open (a hung machine, a cut link) holds every rank
in its next collective for ``parallel.timeout_s`` (600 s by default) before anything is said. Here
each rank runs a thread with a connection of its own to the job's rendezvous store (the TCP store
the process group was made with, as :mod:`~moe_dist.distributed.roll_call` records it): every
``period`` seconds it advances its own counter, reads its successor's (rank + 1, around the ring)
and reads the job's verdict key. A successor whose counter has not moved for ``timeout_s`` is
silent: the rank reads every rank's counter once, writes the verdict naming the silent node(s),
and ends; every other rank ends when it reads the verdict. A rank that cannot reach the store
for ``timeout_s`` is cut off from the job itself, or the store's node is lost, and says that.

The process ends from the thread (the command's ``on_loss``; for the trainer
:func:`moe_dist.exits.end_process`: one line, the launcher's report, exit code 1): the main thread
may be blocked in a collective that nothing in Python can interrupt. A rank that stops normally
marks itself done first, so that its watcher does not take its silence for a loss. Each rank sends
the store five small requests a period; a second thread without I/O decides when the store has
been silent too long (a request to a store that stopped answering may block for good).

    start(timeout_s=30)     # every rank, once roll_call.remember_hosts has run
    ...
    stop()                  # on a normal end (bootstrap.shutdown)
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import threading
import time
from typing import Callable, Optional

from . import roll_call

_KEY = "moe_dist/heartbeat"
_running: Optional["Heartbeat"] = None


def period_for(timeout_s: float) -> float:
    """Seconds between beats: a fifth of the timeout, 0.2 to 5 s."""
    return min(5.0, max(0.2, timeout_s / 5))


class Heartbeat:
    """One rank's beat and its watch of the next rank (module docstring). ``on_loss(line)`` is what
    ends the rank (default: the line on stderr, exit code 1)."""

    def __init__(self, store_at: tuple[str, int], rank: int, hosts: list[str], timeout_s: float,
                 on_loss: Optional[Callable[[str], None]] = None, period_s: Optional[float] = None):
        self.store_at, self.rank, self.hosts, self.timeout_s = store_at, rank, list(hosts), float(timeout_s)
        self.world = len(self.hosts)
        self.period = period_s or period_for(self.timeout_s)
        self.prefix = f"{_KEY}/{roll_call.attempt()}"
        self.on_loss = on_loss or _end_process
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moe_dist-heartbeat", daemon=True)
        # a request to a store whose host stopped answering can block for good: a second thread,
        # without I/O, watches when the store last answered
        self._clock = threading.Thread(target=self._watch_store, name="moe_dist-heartbeat-clock", daemon=True)
        self._store = None
        self._reached = time.monotonic()  # when the store last answered
        self._ended = threading.Lock()

    def start(self) -> "Heartbeat":
        self._thread.start()
        self._clock.start()
        return self

    def _end(self, line: str) -> None:
        """``on_loss(line)`` once, whichever thread finds the loss first."""
        if self._ended.acquire(blocking=False):
            self.on_loss(line)

    def _watch_store(self) -> None:
        while not self._stop.wait(self.period):
            if time.monotonic() - self._reached > self.timeout_s:
                host, port = self.store_at
                return self._end(
                    f"rank {self.rank}: the job's rendezvous store at {host}:{port} has not answered for "
                    f"{self.timeout_s:g} s (parallel.heartbeat_timeout_s): {roll_call.cut_off(self.hosts[self.rank])}; "
                    "the job was stopped (resume=auto continues from the last checkpoint)")

    def stop(self, wait_for_all: bool = True) -> None:
        """Mark this rank done (best effort, on a connection of its own) and end the threads. On a
        normal end rank 0, whose process holds the store when the job was not started by torchrun,
        waits (up to the timeout) until every rank is done: leaving first, it would take the store
        from ranks that still beat and make them think themselves cut off. ``wait_for_all`` False
        (the job is failing; a peer may be gone): no wait."""
        self._stop.set()
        try:
            store = self._client()
            store.set(f"{self.prefix}/done/{self.rank}", "1")
            deadline = time.monotonic() + self.timeout_s
            while wait_for_all and self.rank == 0 and time.monotonic() < deadline and not all(
                    store.check([f"{self.prefix}/done/{r}"]) for r in range(self.world)):
                time.sleep(0.05)
        except (RuntimeError, OSError):  # the store is gone: nothing is watching any more
            pass
        self._thread.join(timeout=2 * self.period + 1)

    def _client(self):
        """A new connection to the store. A plain socket tries first: torch's store logs every failed
        connection attempt to stderr (a cut-off rank would repeat it every period), a socket does not."""
        import torch.distributed as dist

        host, port = self.store_at
        socket.create_connection((host, port), timeout=max(1.0, self.period)).close()  # OSError if unreachable
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=max(1.0, self.period)))

    def _connect(self):
        if self._store is None:
            self._store = self._client()
        return self._store

    def _run(self) -> None:
        successor = (self.rank + 1) % self.world
        beat, seen, moved = 0, None, time.monotonic()  # the successor's last counter and when it last moved
        watching = True
        while not self._stop.wait(self.period if beat else 0.0):
            now = time.monotonic()
            try:
                store = self._connect()
                beat += 1
                store.set(f"{self.prefix}/{self.rank}", str(beat))
                if store.check([f"{self.prefix}/verdict"]):
                    return self._end(f"rank {self.rank}: {store.get(f'{self.prefix}/verdict').decode()}")
                self._reached = now
                if not watching:
                    continue
                if store.check([f"{self.prefix}/done/{successor}"]):
                    watching = False  # the job is ending normally; this rank still beats for its own watcher
                    continue
                value = store.get(f"{self.prefix}/{successor}") if store.check([f"{self.prefix}/{successor}"]) \
                    else None
                if value != seen:
                    seen, moved = value, now
                elif now - moved > self.timeout_s:
                    silent = self._silent_ranks(store)
                    if not silent:  # it moved after all (this thread was slow): watch on
                        moved = time.monotonic()
                        continue
                    verdict = self._verdict(silent)
                    store.set(f"{self.prefix}/verdict", verdict)
                    # the others read it within a period: ending first would fail their collectives
                    # with a lost peer (this rank) before they could say which node is gone
                    self._stop.wait(self.period * 1.5)
                    return self._end(f"rank {self.rank}: {verdict}")
            except (RuntimeError, OSError):  # no answer within a period: a refused or timed-out connection
                self._store = None  # a new connection next time (the clock thread decides when to give up)

    def _silent_ranks(self, store) -> list[int]:
        """The ranks whose counters do not move over one more period (the successor among them)."""
        def counters() -> dict[int, Optional[bytes]]:
            keys = [f"{self.prefix}/{r}" for r in range(self.world)]
            present = [store.check([k]) for k in keys]
            values = store.multi_get([k for k, p in zip(keys, present) if p]) if any(present) else []
            it = iter(values)
            return {r: (next(it) if p else None) for r, p in enumerate(present)}

        before = counters()
        time.sleep(self.period * 1.5)
        after = counters()
        return sorted(r for r in range(self.world) if r != self.rank and after[r] == before[r]
                      and not store.check([f"{self.prefix}/done/{r}"]))

    def _verdict(self, silent: list[int]) -> str:
        named = roll_call.name_ranks(self.hosts, silent)
        return (f"no heartbeat from {named} for {self.timeout_s:g} s (parallel.heartbeat_timeout_s): the job was "
                "stopped (resume=auto continues from the last checkpoint)")


def _end_process(line: str) -> None:
    """The line on stderr, then exit code 1 (a command passes its own ending: moe_dist.exits.end_process)."""
    print(line, file=sys.stderr, flush=True)
    os._exit(1)


def start(timeout_s: float, on_loss: Optional[Callable[[str], None]] = None) -> Optional[Heartbeat]:
    """This rank's heartbeat, when the job has several ranks and a recorded TCP store (else None);
    ``timeout_s`` 0: none. ``on_loss(line)`` ends the rank (default: the line, then exit code 1)."""
    global _running
    store_at, hosts, rank = roll_call.store_at(), roll_call.hosts(), roll_call.rank()
    if not timeout_s or store_at is None or len(hosts) < 2:
        return None
    stop()
    _running = Heartbeat(store_at, rank, hosts, timeout_s, on_loss=on_loss).start()
    return _running


def stop(wait_for_all: bool = True) -> None:
    """Stop this rank's heartbeat, if it runs, marking the rank done (:meth:`Heartbeat.stop`)."""
    global _running
    if _running is not None:
        _running.stop(wait_for_all)
        _running = None
