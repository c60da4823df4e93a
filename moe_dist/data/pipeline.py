"""``moe-dist prepare``'s engine: inputs -> N tokenizer workers -> indexed shards + manifest.

    summary = run_prepare(PrepareSettings(inputs=[...], output="data/web", tokenizer="tok.model"))

The main process reads chunks (:mod:`.sources`), hands each to a worker pool
(:mod:`.encode`) with a bounded number in flight, and appends the results, in input order, to
the current shard's training and validation files (:mod:`.indexed`). A shard closes once it
covers ``shard_mb`` of input: its files are renamed into place and a small record
(``shard-NNNNN.json``: counts, named bad records, where in the input it ends) is written
atomically. A prepare run again on the same output continues after the last recorded shard;
``manifest.json``, written last, is what training reads, so nothing half-written is used.
Memory is bounded by ``memory_mb`` through the chunk size and the number of chunks in flight.
"""
from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from ..errors import InputError, UserError
from ..safe_io import MIB, UnreadableFile, read_json, write_json_atomically
from .encode import encode_chunk, init_worker
from .indexed import IndexedWriter, token_dtype
from .sources import find_inputs, read_chunks
from .tokenizer import Tokenizer

FORMAT = "moe_dist.indexed/1"
MANIFEST = "manifest.json"
PROGRESS = "prepare.json"
SHOWN_BAD = 10  # bad records named in the manifest (all are counted)
WORKER_MB = 80  # a worker's memory before any chunk: interpreter, numpy, tokenizer
EXPANSION = 12  # memory held per byte of a chunk in flight (raw bytes, the pickled copy, str, token arrays)


@dataclass
class PrepareSettings:
    inputs: list
    output: str
    tokenizer: Optional[str] = None  # a tokenizer file or a model directory (or pass tokenizer_obj)
    format: str = "auto"
    pattern: Optional[str] = None
    field: str = "text"
    val_fraction: float = 0.01
    workers: int = 0  # 0: one per core; 1: in this process
    memory_mb: int = 2048
    shard_mb: float = 1024  # input MiB per shard
    max_record_mb: int = 64
    progress: bool = True
    chunk_kb: Optional[int] = None  # input per worker task (None: from memory_mb)
    task: int = 0  # this task's slice of the input files, of ``tasks`` (a Slurm array: contiguous, by size)
    tasks: int = 1

    def check(self) -> None:
        if not 0 <= self.val_fraction <= 0.5:
            raise UserError(f"val_fraction={self.val_fraction}: allowed 0 to 0.5")
        for key in ("memory_mb", "max_record_mb"):
            if getattr(self, key) < 1:
                raise UserError(f"{key}={getattr(self, key)}: allowed at least 1")
        if not self.shard_mb > 0:
            raise UserError(f"shard_mb={self.shard_mb}: allowed a number > 0")
        if not 0 <= self.task < self.tasks:
            raise UserError(f"task {self.task} of {self.tasks}: allowed 0 <= task < tasks")
        if self.workers < 0:
            raise UserError(f"workers={self.workers}: allowed 0 (one per core) or more")


def _plan(s: PrepareSettings) -> tuple[int, int, int]:
    """(workers, chunks in flight, chunk bytes) within ``memory_mb``."""
    workers = s.workers or len(os.sched_getaffinity(0))
    in_flight = 2 * workers if workers > 1 else 1
    spare = max(s.memory_mb - 100 - (WORKER_MB * workers if workers > 1 else 0), 16) * 2**20
    chunk = int(min(max(spare / (in_flight * EXPANSION), 256 << 10), 16 << 20))
    if s.chunk_kb:
        chunk = s.chunk_kb << 10
    return workers, in_flight, chunk


def _fingerprint(s: PrepareSettings, files, tok: Tokenizer) -> str:
    """What the shards depend on: the input files (name, size, mtime), the tokenizer and the settings."""
    spec = {"files": [(f.name, f.size, os.stat(f.path).st_mtime_ns) for f in files], "tokenizer": tok.sha256,
            "field": s.field, "format": s.format, "val_fraction": s.val_fraction, "shard_mb": s.shard_mb,
            "max_record_mb": s.max_record_mb, "format_version": FORMAT}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def task_files(files: list, task: int, tasks: int) -> list:
    """Task ``task``'s contiguous run of ``files``, the runs about equal in bytes (a file is never split)."""
    if tasks == 1:
        return files
    total = max(sum(f.size for f in files), 1)
    out, before = [], 0
    for f in files:
        if min(before * tasks // total, tasks - 1) == task:
            out.append(f)
        before += f.size
    return out


def read_record(path: str) -> dict:
    """A manifest or shard record, read bounded (a FIFO, a device or a file cut short: one line)."""
    try:
        value = read_json(path, 256 * MIB)
    except UnreadableFile as e:
        raise InputError(f"{e}; prepare it again") from None
    if not isinstance(value, dict):
        raise InputError(f"{path}: not a JSON object; prepare it again")
    return value


def write_record(path: str, obj: dict) -> None:
    """A record of prepare (its progress, a shard's end, the manifest), written whole or not at all:
    a fresh temporary file renamed over ``path`` (never through a link), fsynced; read by :func:`read_record`."""
    write_json_atomically(path, obj, durable=True, indent=1, sort_keys=True)


def _finished_shards(out: str) -> list[dict]:
    shards = []
    while os.path.isfile(path := os.path.join(out, f"shard-{len(shards):05d}.json")):
        shards.append(read_record(path))
    return shards


@dataclass
class _Shard:
    index: int
    train: IndexedWriter
    val: IndexedWriter
    input_bytes: int = 0
    characters: int = 0
    empty: int = 0
    bad: list = field(default_factory=list)
    bad_count: int = 0

    def record(self, end: tuple) -> dict:
        return {"index": self.index, "train": os.path.basename(self.train.prefix), "val": os.path.basename(self.val.prefix),
                "train_tokens": self.train.tokens, "train_documents": self.train.documents,
                "val_tokens": self.val.tokens, "val_documents": self.val.documents, "input_bytes": self.input_bytes,
                "characters": self.characters, "empty_records": self.empty, "bad_count": self.bad_count,
                "bad": self.bad, "end": list(end)}


def _open_shard(out: str, index: int, dtype) -> _Shard:
    return _Shard(index, IndexedWriter(os.path.join(out, f"train-{index:05d}"), dtype),
                  IndexedWriter(os.path.join(out, f"val-{index:05d}"), dtype))


def _bar(s: PrepareSettings, total: int, done: int):
    if not s.progress:
        return None
    from tqdm import tqdm

    # a compressed input's offsets count its decompressed bytes: no total (and no time left) for those
    return tqdm(total=total, initial=done, unit="B", unit_scale=True, unit_divisor=1024, desc="prepare",
                dynamic_ncols=True, smoothing=0.1)


def run_prepare(s: PrepareSettings, tokenizer: Optional[Tokenizer] = None, log: Callable[[str], None] = print) -> dict:
    """Prepare (or finish preparing) ``s.output``; returns its manifest."""
    s.check()
    t0 = time.perf_counter()
    out = s.output
    if tokenizer is None:
        if not s.tokenizer:
            raise UserError("prepare needs a tokenizer: --tokenizer names a tokenizer.model, a tokenizer.json or a "
                            "model directory holding one")
        tokenizer = Tokenizer.resolve(s.tokenizer)
    files = task_files(find_inputs(s.inputs, s.format, s.pattern), s.task, s.tasks)
    fp = _fingerprint(s, files, tokenizer)
    if os.path.isfile(os.path.join(out, MANIFEST)):
        _check_same(out, fp)
        manifest = read_record(os.path.join(out, MANIFEST))
        log(f"prepare: {out} is already complete ({manifest['token_count']:,} tokens); nothing to do")
        return manifest
    shards = _start_output(s, fp, log)
    position = tuple(shards[-1]["end"]) if shards else (0, 0, 0)
    dtype = token_dtype(tokenizer.vocab_size)
    workers, in_flight, chunk_bytes = _plan(s)
    max_record = min(s.max_record_mb << 20, (s.memory_mb << 20) // 8)  # one record's text, ids and copies fit
    total_bytes = sum(f.size for f in files)
    state = {"tok": tokenizer, "field": s.field, "val": s.val_fraction, "dtype": dtype}
    pool = None
    if workers > 1:
        ctx = multiprocessing.get_context("fork")  # workers import nothing that a fork breaks (no torch)
        pool = ctx.Pool(workers, initializer=init_worker, initargs=(tokenizer.proto, s.field, s.val_fraction, dtype.str))
    compressed = any(f.path.endswith((".gz", ".zst")) for f in files)
    bar = _bar(s, None if compressed else total_bytes, sum(sh["input_bytes"] for sh in shards))
    writer = _ShardWriter(out, s.shard_mb * 2**20, dtype, shards, position, bar)
    try:
        chunks = read_chunks(files, position, chunk_bytes, max_record, s.field)
        for encoded, meta in _encode_all(chunks, pool, in_flight, state):
            writer.take(encoded, meta)
        writer.finish()
    except BaseException:
        writer.abandon()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if bar is not None:
            bar.close()
    manifest = _manifest(s, files, tokenizer, dtype, shards, time.perf_counter() - t0)
    tokenizer.save(os.path.join(out, tokenizer.file_name))
    write_record(os.path.join(out, MANIFEST), manifest)
    log(summary_line(manifest, out))
    return manifest


def _start_output(s: PrepareSettings, fp: str, log: Callable[[str], None]) -> list:
    """Start ``s.output`` or go on with it: the shards an interrupted run finished (the same inputs and
    settings, checked), the leftovers of the shard it was writing removed."""
    out = s.output
    os.makedirs(out, exist_ok=True)
    progress_path = os.path.join(out, PROGRESS)
    shards = []
    if os.path.isfile(progress_path):
        _check_same(out, fp)
        shards = _finished_shards(out)
    else:
        write_record(progress_path, {"fingerprint": fp, "settings": asdict(s)})
    for name in os.listdir(out):
        if name.endswith(".tmp"):
            os.remove(os.path.join(out, name))
    if shards:
        log(f"prepare: resuming {out} after {len(shards)} finished shard(s)")
    return shards


def _encode_all(chunks, pool, in_flight: int, state: dict):
    """(encoded chunk, (its end position, its input bytes)) in input order: here, or by ``pool`` with at
    most ``in_flight`` chunks held at once."""
    if pool is None:
        for chunk in chunks:
            yield encode_chunk(chunk, state), (chunk.end, chunk.bytes)
        return
    pending: collections.deque = collections.deque()
    for chunk in chunks:
        pending.append((pool.apply_async(encode_chunk, (chunk,)), (chunk.end, chunk.bytes)))
        del chunk
        while len(pending) >= in_flight:
            result, meta = pending.popleft()
            yield result.get(), meta
    while pending:
        result, meta = pending.popleft()
        yield result.get(), meta


class _ShardWriter:
    """Adds encoded chunks to the open shard and closes it at ``shard_bytes`` of input; ``shards`` (the
    finished shards' records) grows as it goes."""

    def __init__(self, out: str, shard_bytes: int, dtype, shards: list, position: tuple, bar) -> None:
        self.out, self.shard_bytes, self.dtype, self.shards, self.bar = out, shard_bytes, dtype, shards, bar
        self.end = position
        self.shard = _open_shard(out, len(shards), dtype)

    def take(self, encoded, meta) -> None:
        shard = self.shard
        self.end, nbytes = meta
        shard.train.add(*encoded.train)
        shard.val.add(*encoded.val)
        shard.input_bytes += nbytes
        shard.characters += encoded.characters
        shard.empty += encoded.empty
        shard.bad_count += len(encoded.bad)
        shard.bad.extend(encoded.bad[: max(SHOWN_BAD - len(shard.bad), 0)])
        if self.bar is not None:
            self._show(nbytes)
        if shard.input_bytes >= self.shard_bytes:
            _close(shard, self.end)
            self.shards.append(shard.record(self.end))
            self.shard = _open_shard(self.out, len(self.shards), self.dtype)

    def _show(self, nbytes: int) -> None:
        shard, shards = self.shard, self.shards
        done_docs = sum(sh["train_documents"] + sh["val_documents"] for sh in shards)
        done_tok = sum(sh["train_tokens"] + sh["val_tokens"] for sh in shards)
        self.bar.set_postfix_str(f"{done_docs + shard.train.documents + shard.val.documents:,} docs, "
                                 f"{done_tok + shard.train.tokens + shard.val.tokens:,} tokens", refresh=False)
        self.bar.update(nbytes)

    def finish(self) -> None:
        """Close the last shard if it holds anything (or is the only one), else drop it."""
        if self.shard.input_bytes or self.shard.bad_count or not self.shards:
            _close(self.shard, self.end)
            self.shards.append(self.shard.record(self.end))
        else:
            self.abandon()

    def abandon(self) -> None:
        self.shard.train.abandon()
        self.shard.val.abandon()


def _check_same(out: str, fp: str) -> None:
    """``out`` was (being) prepared from these inputs and settings."""
    path = os.path.join(out, PROGRESS)
    if os.path.isfile(path) and read_record(path).get("fingerprint") != fp:
        raise InputError(f"{out} holds a prepare of other inputs or settings (files, sizes, tokenizer, "
                         "field, val_fraction, shard_mb); name another output directory or delete it")


def _close(shard: _Shard, end: tuple) -> None:
    shard.train.finish()
    shard.val.finish()
    write_record(os.path.join(os.path.dirname(shard.train.prefix), f"shard-{shard.index:05d}.json"),
                shard.record(end))


def _manifest(s: PrepareSettings, files, tok: Tokenizer, dtype, shards: list[dict], seconds: float) -> dict:
    bad = [b for sh in shards for b in sh["bad"]][:SHOWN_BAD]
    splits = {split: {"tokens": sum(sh[f"{split}_tokens"] for sh in shards),
                      "documents": sum(sh[f"{split}_documents"] for sh in shards)} for split in ("train", "val")}
    return {
        "format": FORMAT,
        "source": {"inputs": [os.path.abspath(i) if os.path.exists(i) else i for i in s.inputs], "files": len(files),
                   "bytes": sum(f.size for f in files), "format": s.format, "pattern": s.pattern, "field": s.field},
        "tokenizer": {"sha256": tok.sha256, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "file": tok.file_name},
        "dtype": dtype.str,
        "validation": {"rule": "a document is held out when sha256(its name) / 2**256 < val_fraction; its name is "
                               "the file's relative path, with :LINE for a JSON-lines record or Parquet row",
                       "val_fraction": s.val_fraction},
        "shards": [{k: sh[k] for k in ("train", "val", "train_tokens", "train_documents", "val_tokens",
                                        "val_documents", "input_bytes")} for sh in shards],
        "splits": splits,
        "token_count": splits["train"]["tokens"] + splits["val"]["tokens"],
        "documents": splits["train"]["documents"] + splits["val"]["documents"],
        "characters": sum(sh["characters"] for sh in shards),
        "empty_records": sum(sh["empty_records"] for sh in shards),
        "bad": {"count": sum(sh["bad_count"] for sh in shards), "first": [list(b) for b in bad]},
        "seconds": round(seconds, 2),
        "task": [s.task, s.tasks],
    }


def summary_line(m: dict, out: str) -> str:
    mb = m["source"]["bytes"] / 2**20
    bad = m["bad"]
    named = "; ".join(f"{w}: {why}" for w, why in bad["first"][:3])
    bad_text = f", {bad['count']} bad record(s) left out ({named}{'; ...' if bad['count'] > 3 else ''})" if bad["count"] \
        else ", no bad records"
    empty = f", {m['empty_records']} empty record(s)" if m["empty_records"] else ""
    return (f"prepare: {m['documents']:,} documents from {m['source']['files']} file(s), {mb:,.1f} MiB -> "
            f"{m['splits']['train']['tokens']:,} train / {m['splits']['val']['tokens']:,} val tokens in "
            f"{len(m['shards'])} shard(s), {m['seconds']:.1f}s ({mb / max(m['seconds'], 1e-9):.1f} MiB/s)"
            f"{bad_text}{empty} -> {out}")
