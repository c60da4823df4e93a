"""In-memory snapshots (``ckpt.memory_every``): every rank's shard of the training state, kept in its
node's host memory and copied to a buddy rank on another node, so a lost node costs a step, not a
checkpoint interval.

At a snapshot step each rank copies its state dict (the disk checkpoint's: model and optimizer
keyed by global expert, its RNG states; :mod:`.state`, :mod:`.rng`) and the trainer's
``meta.json`` (sampler position, counters, schedule, routing diagnostics) on the training
thread; a background thread then writes it to the node's :class:`~.holder.Holder` (host memory
that outlives the worker processes) and sends it over a gloo group of the job's own ranks to its
buddy, which writes it to its own node's holder. At most one snapshot is in flight.

After a restart (:meth:`Snapshots.restore`, collective) every rank says which shards its node
holds; the newest step of which the survivors hold a complete set (every rank of the world that
saved it), newer than the newest disk checkpoint, is chosen (:func:`choose`); shards a node lacks
are sent to it by a node that has them; each node merges the shards into one checkpoint
directory, which the disk checkpoint's loader reads and reshards to the new layout.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import socket
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ...distributed.groups import new_group
from ...distributed.roll_call import hosts
from ...distributed.topology import node_of_ranks
from .checkpointer import config_sha256
from .collective import all_gather, barrier, distributed
from .files import FORMAT, FORMAT_VERSION, MARKER, META, CheckpointError, write_json_durably
from .holder import Holder, Shard, Slots, merge, pack, unpack
from .raw_shard import copy_in, index_json, layout, signature

FINGERPRINT_SECTIONS = ("model", "train", "data")  # what decides the trajectory a snapshot continues


def run_id(run_dir: str) -> str:
    """The job a snapshot belongs to: its run directory and the job's id: Slurm's job id (the same over
    the batch script's relaunches), else torchrun's rendezvous id (the same over elastic restarts);
    another job on the same directory has another."""
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"{os.path.realpath(run_dir)}|{job}"


def fingerprint(config: dict, tokenizer_sha256: str) -> str:
    return config_sha256({**{k: config.get(k) for k in FINGERPRINT_SECTIONS}, "tokenizer": tokenizer_sha256})


def buddies(nodes: tuple[int, ...]) -> list[Optional[int]]:
    """Each rank's buddy: the rank of the same position on the next node (None on one node)."""
    count = max(nodes) + 1 if nodes else 1
    if count < 2:
        return [None] * len(nodes)
    on = [[r for r, n in enumerate(nodes) if n == k] for k in range(count)]
    return [on[(n + 1) % count][on[n].index(r) % len(on[(n + 1) % count])] for r, n in enumerate(nodes)]


def choose(reports: list[tuple[str, list[Shard]]], newer_than: int) -> Optional[tuple[int, int]]:
    """(step, world) of the newest snapshot of which ``reports`` (each rank's node and the shards that
    node holds) hold every shard, or None; only steps after ``newer_than`` (the disk checkpoint's)."""
    held: dict[int, dict[int, set[int]]] = {}  # step -> world -> shard ranks held somewhere
    for _node, shards in reports:
        for s in shards:
            held.setdefault(s.step, {}).setdefault(s.world, set()).add(s.rank)
    for step in sorted(held, reverse=True):
        if step <= newer_than:
            break
        complete = [w for w, ranks in held[step].items() if ranks == set(range(w))]
        if len(held[step]) == 1 and complete:
            return step, complete[0]
    return None


class Snapshots:
    """One rank's part of the job's in-memory snapshots (collective constructor: makes a gloo group)."""

    def __init__(self, run_dir: str, config: dict, tokenizer_sha256: str, log: Callable[[str], None] = print):
        self.run_id, self.fingerprint, self.log = run_id(run_dir), fingerprint(config, tokenizer_sha256), log
        self.rank = dist.get_rank() if distributed() else 0
        self.world = dist.get_world_size() if distributed() else 1
        names = hosts() if self.world > 1 else []
        self.hosts = names if len(names) == self.world else [socket.gethostname()] * self.world
        self.nodes = node_of_ranks(self.hosts)
        self.buddy = buddies(self.nodes)
        self.holder = Holder(hashlib.sha256(self.run_id.encode()).hexdigest()[:20], self.hosts[self.rank])
        self.group = new_group(backend="gloo", name="snapshot") if distributed() else None
        self.sources = [r for r, b in enumerate(self.buddy) if b == self.rank]  # whose copies this rank keeps
        here = [r for r, n in enumerate(self.nodes) if n == self.nodes[self.rank]]
        self._written_here = set(here) | {r for r, b in enumerate(self.buddy) if b in here}
        self.checksums = bool(config.get("ckpt", {}).get("verify", True))  # of the merged directory, for its loader
        self.off = False  # switched off for the job (a rank could not keep its part)
        self._items, self._signature, self._index = None, None, ""
        self._own: Optional[Slots] = None
        self._kept: dict[int, Slots] = {}
        self._thread: Optional[threading.Thread] = None  # one worker for the run: no thread start per snapshot
        self._work: queue.Queue = queue.Queue()
        self._idle = threading.Event()  # no snapshot in flight (cleared by take, set by the worker)
        self._idle.set()
        self._error: Optional[BaseException] = None
        self._problems: list[str] = []

    @property
    def leader(self) -> bool:
        """The lowest rank of this node: it writes what the node holds once."""
        return self.nodes.index(self.nodes[self.rank]) == self.rank

    # ---- taking one ------------------------------------------------------------------------------------
    def take(self, step: int, state: dict[str, torch.Tensor], meta: dict, manifest: dict) -> None:
        """Copy ``state`` (this rank's state dict) now into this rank's older generation; publish it and
        send it to the buddy in the background. Collective at the first call (the buffers are allocated)."""
        self.wait()
        if self.off:
            return
        if self._items is None:
            self._prepare(step, state)
            if self.off:
                return
        elif signature(state) != self._signature:
            raise CheckpointError("the state's tensors changed shape or dtype between two snapshots; "
                                  "snapshots need one layout for the whole run")
        region, _tmp = self._own.stage(step, self._index)
        copy_in(region, self._items, state)
        marker = {"run_id": self.run_id, "fingerprint": self.fingerprint, "world": self.world, "manifest": manifest}
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="snapshot-worker", daemon=True)
            self._thread.start()
        self._idle.clear()
        self._work.put((step, region, meta, marker))

    def _worker(self) -> None:
        while True:
            job = self._work.get()
            if job is None:
                return
            try:
                self._in_background(*job)
            finally:
                self._idle.set()

    def _prepare(self, step: int, state: dict) -> None:
        """Collective, at the first snapshot: the layout, and both generations of this rank's shard and
        of the shards it keeps for others allocated in host memory. A rank that cannot (its holder full,
        ENOSPC) switches snapshots off for the whole job; rank 0 says so once."""
        problem, nbytes = None, 0
        try:
            self._items, nbytes = layout(state)
            self._signature, self._index = signature(state), index_json(self._items, nbytes)
        except CheckpointError as e:  # a state that is not tensor blocks (an engine's own objects)
            problem = f"rank {self.rank}: {e}"
        sizes = all_gather(nbytes, self.group)
        try:
            if problem is None:
                self._own = Slots(self.holder, self.rank, nbytes, step)
                for source in self.sources:
                    self._kept[source] = Slots(self.holder, source, sizes[source], step)
        except OSError as e:
            need = (nbytes + sum(sizes[s] for s in self.sources)) * 2 / 2**20
            problem = f"rank {self.rank} cannot keep {need:.0f} MiB in {self.holder.path}: {e}"
        self._switch_off([p for p in all_gather(problem, self.group) if p])

    def _switch_off(self, problems: list[str]) -> None:
        if not problems:
            return
        self.off = True
        if self.rank == 0:
            self.log(f"in-memory snapshots switched off for the rest of the job: {problems[0]}; training goes on, "
                     "a lost node costs the steps since the last disk checkpoint (ckpt.every)")
        for slots in [self._own, *self._kept.values()]:
            if slots is not None:
                slots.release()
        self._own, self._kept = None, {}

    def wait(self) -> None:
        """Finish the snapshot in flight; its failure is raised here, on the training thread (a rank that
        could not write its part switches snapshots off, on every rank)."""
        self._idle.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"in-memory snapshot: {type(error).__name__}: {error}") from error
        if self._problems:
            problems, self._problems = self._problems, []
            self._switch_off(problems)

    def _in_background(self, step: int, region, meta: dict, marker: dict) -> None:
        """Publish this rank's entry, swap entries with the buddies, agree on whether every rank could.
        A file that cannot be written (OSError: the holder full) switches snapshots off on every rank at
        the next :meth:`wait`; another error is raised there on its rank (the others switch off)."""
        try:
            problems: list[tuple[str, Exception]] = []

            def publish():
                write_json_durably(os.path.join(self._own.gens[self._own.turn][1], META), meta)
                self._own.publish(step, marker)

            _locally(problems, publish, f"rank {self.rank} cannot write its snapshot of step {step} in {self.holder.path}")
            if self.buddy[self.rank] is not None:
                header = json.dumps({"step": step, "marker": marker, "meta": meta, "index": self._index}).encode()
                self._exchange(step, region, header, problems)
            failed = torch.tensor([bool(problems)], dtype=torch.int32)
            if self.group is not None:
                dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
            if failed.item():
                self._problems = [p for p in all_gather(problems[0][0] if problems else None, self.group) if p]
                self._error = next((e for _t, e in problems if not isinstance(e, OSError)), None)
                return
            self.holder.prune(step, lambda shard: shard == self.rank or shard in self._kept)
            if self.leader:  # shards nobody of this node writes now (an earlier world's)
                self.holder.prune(step, lambda shard: shard not in self._written_here)
        except BaseException as e:  # noqa: BLE001 - raised by wait() on the training thread
            self._error = e

    def _exchange(self, step: int, region, header: bytes, problems: list) -> None:
        """Send this rank's entry (its header and straight from its data buffer) to its buddy; receive
        those whose buddy this rank is straight into their older generation here. What cannot be kept
        here goes to ``problems``; the transfers happen either way (the peers are not left waiting)."""
        buddy, g = self.buddy[self.rank], self.group
        sizes = {src: torch.zeros(2, dtype=torch.int64) for src in self.sources}
        works = [dist.isend(torch.tensor([len(header), region.nbytes], dtype=torch.int64), buddy, group=g, tag=10)]
        works += [dist.irecv(box, src, group=g, tag=10) for src, box in sizes.items()]
        for w in works:
            w.wait()
        head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        works = [dist.isend(head, buddy, group=g, tag=11), dist.isend(region.buf, buddy, group=g, tag=12)]
        incoming = {}
        for src, box in sizes.items():
            n_head, n_data = (int(x) for x in box.tolist())
            staged = self._stage_kept(src, step, n_data, problems)  # None: received, then dropped
            data = staged[0].buf if staged is not None else torch.empty(n_data, dtype=torch.uint8)
            incoming[src] = (torch.empty(n_head, dtype=torch.uint8), staged)
            works += [dist.irecv(incoming[src][0], src, group=g, tag=11), dist.irecv(data, src, group=g, tag=12)]
        for w in works:
            w.wait()
        for src, (head_in, staged) in incoming.items():
            if staged is not None:
                _locally(problems, lambda s=src, h=head_in, t=staged[1]: self._keep(s, step, h, t),
                         f"rank {self.rank} cannot keep rank {src}'s snapshot of step {step}")

    def _stage_kept(self, src: int, step: int, n_data: int, problems: list):
        """(region, dir) of the older generation of ``src``'s copy here, ready to receive ``n_data`` bytes;
        None (and a problem) when it cannot."""
        slots = self._kept[src]
        if n_data != slots.nbytes:
            problems.append((f"rank {src}'s snapshot of step {step} is not of the size agreed at the first one",
                             CheckpointError(f"rank {src} sent {n_data} bytes, not {slots.nbytes}")))
            return None
        try:
            return slots.stage(step, None)
        except OSError as e:
            problems.append((f"rank {self.rank} cannot keep rank {src}'s snapshot of step {step}: {e}", e))
            return None

    def _keep(self, src: int, step: int, head_bytes: torch.Tensor, tmp: str) -> None:
        """Publish rank ``src``'s entry received into ``tmp`` (its index and meta from its header)."""
        head = json.loads(bytes(head_bytes.numpy().tobytes()))
        marker = head["marker"]
        if (head["step"], marker.get("run_id"), marker.get("fingerprint")) != (step, self.run_id, self.fingerprint):
            raise CheckpointError(f"rank {src} sent a snapshot of another step, job or config")
        slots = self._kept[src]
        slots.write_index(head["index"])
        write_json_durably(os.path.join(tmp, META), head["meta"])
        slots.publish(step, marker)

    # ---- restoring -------------------------------------------------------------------------------------
    def _accept(self, marker: dict) -> Optional[str]:
        if marker.get("run_id") != self.run_id:
            return f"saved by another job ({marker.get('run_id')!r}, this one is {self.run_id!r})"
        if marker.get("fingerprint") != self.fingerprint:
            return "saved under another model/train/data config"
        return None

    def restore(self, newer_than: int) -> Optional[tuple[str, int]]:
        """Collective: (this node's merged checkpoint directory, step) of the newest complete
        snapshot after step ``newer_than``, every shard fetched to every node; None when there is none."""
        try:
            shards, refused = self.holder.complete(self._accept)
        except OSError as e:
            shards, refused = [], [f"{self.holder.path}: {e}"]
        reports = all_gather((self.hosts[self.rank], shards, refused), self.group)
        refusals = sorted({line for _n, _s, lines in reports for line in lines})
        if refusals and self.rank == 0:
            self.log(f"resume: {len(refusals)} in-memory snapshot shard(s) refused, e.g. {refusals[0]}; "
                     "they are not used")
        chosen = choose([(node, s) for node, s, _ in reports], newer_than)
        if chosen is None:
            return None
        step, world = chosen
        error = self._fetch(step, world, [(node, [s for s in held if s.step == step]) for node, held, _ in reports])
        if self.leader and error is None:
            try:
                saved = self._marker_manifest(step)
                merge(self.holder, step, world, {**saved, "format": FORMAT, "version": FORMAT_VERSION, "step": step},
                      checksums=self.checksums)
            except (OSError, ValueError, CheckpointError) as e:
                error = f"cannot assemble the snapshot of step {step} on {self.holder.node}: {e}"
        errors = [e for e in all_gather(error, self.group) if e]
        if errors:
            raise CheckpointError(errors[0])
        return self.holder.merged(step), step

    def _marker_manifest(self, step: int) -> dict:
        from ...safe_io import read_json

        marker = read_json(os.path.join(self.holder.entry(step, 0), MARKER), 1 << 20)
        return dict(marker.get("manifest") or {})

    def _fetch(self, step: int, world: int, reports: list[tuple[str, list[Shard]]]) -> Optional[str]:
        """Every node gets the shards of ``step`` it lacks, from the lowest rank of a node that has them.
        Collective; returns what went wrong on this rank (None: nothing), for the caller to agree on."""
        node_names = [node for node, _ in reports]
        holds: dict[str, set[int]] = {}
        for node, shards in reports:
            holds.setdefault(node, set()).update(s.rank for s in shards)
        leaders = {node: node_names.index(node) for node in holds}
        sends = []  # (source rank, destination rank, shard rank)
        for node in sorted(holds, key=leaders.get):
            for shard in range(world):
                if shard not in holds[node]:
                    source = min(r for r, (n, _) in enumerate(reports) if shard in holds[n])
                    sends.append((source, leaders[node], shard))
        if not sends:
            return None
        mine = [(dst, shard, pack(self.holder.entry(step, shard))) for src, dst, shard in sends if src == self.rank]
        incoming = [(src, shard) for src, dst, shard in sends if dst == self.rank]
        received = _transfer([(self.rank, dst, data) for dst, _shard, data in mine], [src for src, _ in incoming],
                             self.rank, self.group, tags=([s for _d, s, _ in mine], [s for _src, s in incoming]))
        try:
            for (src, shard) in incoming:
                unpack(received[(src, shard)], self.holder, step, shard)
        except (OSError, ValueError, CheckpointError) as e:
            return f"cannot keep the shard of step {step} sent to {self.holder.node}: {e}"
        return None

    def forget_after(self, step: int) -> None:
        """After the resume chose ``step`` (0: a fresh start): this node's entries of later steps belong to
        another timeline (an earlier run on this directory) and are removed before any new one is written."""
        if self.leader:
            self.holder.remove_after(step)

    def done_with(self, path: str) -> None:
        """Collective, after the merged directory was loaded: it is removed (the shards stay)."""
        barrier(self.group)
        if self.leader:
            import shutil

            shutil.rmtree(path, ignore_errors=True)

    def end(self) -> None:
        """Collective, at the normal end of the run: the snapshot in flight finished, this run's
        snapshots removed from every node's host memory."""
        self.wait()
        if self._thread is not None:
            self._work.put(None)
            self._thread.join()
            self._thread = None
        self._own, self._kept = None, {}  # unmapped: the memory goes with the files
        barrier(self.group)
        if self.leader:
            self.holder.remove_all()


def _locally(problems: list, fn: Callable[[], object], what: str) -> None:
    """``fn()``; an exception goes to ``problems`` as (``what: error``, the exception)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - agreed on by every rank, then raised or switched off
        problems.append((f"{what}: {e}", e))


def _transfer(sends: list[tuple[int, int, bytes]], sources: list[int], rank: int, group,
              tags: Optional[tuple[list[int], list[int]]] = None) -> dict:
    """Point-to-point byte strings over ``group`` (whose ranks are the global ranks): each send
    ``(me, destination, data)``; receive one from each of ``sources``. Sizes first, then the data.
    Returns {source: data}, or {(source, tag): data} with ``tags`` (the sends' and the receives')."""
    send_tags, recv_tags = tags if tags is not None else ([0] * len(sends), [0] * len(sources))
    sizes = [torch.tensor([len(data)], dtype=torch.int64) for _me, _dst, data in sends]
    works = [dist.isend(s, dst, group=group, tag=2 * t) for s, (_me, dst, _d), t in zip(sizes, sends, send_tags)]
    boxes = [torch.zeros(1, dtype=torch.int64) for _ in sources]
    works += [dist.irecv(b, src, group=group, tag=2 * t) for b, src, t in zip(boxes, sources, recv_tags)]
    for w in works:
        w.wait()
    payloads = [torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
                for _me, _dst, data in sends]
    works = [dist.isend(p, dst, group=group, tag=2 * t + 1) for p, (_me, dst, _d), t in zip(payloads, sends, send_tags)]
    buffers = [torch.empty(int(b.item()), dtype=torch.uint8) for b in boxes]
    works += [dist.irecv(b, src, group=group, tag=2 * t + 1) for b, src, t in zip(buffers, sources, recv_tags)]
    for w in works:
        w.wait()
    if tags is None:
        return {src: bytes(b.numpy().tobytes()) for src, b in zip(sources, buffers)}
    return {(src, t): bytes(b.numpy().tobytes()) for src, b, t in zip(sources, buffers, recv_tags)}
