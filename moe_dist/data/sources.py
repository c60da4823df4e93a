"""The inputs of a prepare, streamed in bounded chunks.

Inputs are files, directories (searched recursively) and globs of text (a whole file is one
document), JSON lines (``.jsonl``, ``.json``; plain, ``.gz`` or ``.zst``; one record per line)
and Parquet files (one record per row). The main process only reads bytes and cuts them into
chunks of about ``chunk_bytes``; parsing and tokenizing happen in the workers
(:mod:`moe_dist.data.encode`). A chunk never spans two files, and where chunks are cut
depends only on the files and ``chunk_bytes``, so a prepare resumed at a chunk boundary with
the same chunk size cuts the rest exactly as an uninterrupted one.

A document's name (``relative/path`` for a text file, ``relative/path:LINE`` for a JSON-lines
record or Parquet row) decides its validation split, as :func:`moe_dist.data.corpus.is_validation`.
"""
from __future__ import annotations

import glob
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from ..errors import MissingInputError, UserError, install_hint
from .corpus import JSONL_SUFFIXES, TEXT_SUFFIXES

COMPRESSED = (".gz", ".zst")


@dataclass(frozen=True)
class InputFile:
    path: str
    name: str  # relative to the input it was found under
    kind: str  # text | jsonl | parquet
    size: int


@dataclass
class Chunk:
    """A piece of one file's records (or a run of whole text files) for a worker."""

    kind: str
    names: list  # jsonl / parquet: [file name] ; text: each file's name
    records: list  # jsonl: raw line bytes ; parquet: str or None ; text: file bytes
    first_line: int = 1  # jsonl / parquet: the line (row) number of records[0], 1-based
    lines: Optional[list] = None  # jsonl: each record's line number (blank lines are skipped)
    end: tuple = (0, 0, 0)  # the input position after this chunk: (file index, byte offset, line)
    bytes: int = 0  # input bytes this chunk covers
    bad: list = field(default_factory=list)  # (where, why) found while reading: empty files, huge records


def _kind(path: str, fmt: str) -> Optional[str]:
    name = path[: -len(next(s for s in COMPRESSED if path.endswith(s)))] if path.endswith(COMPRESSED) else path
    if fmt != "auto":
        return fmt
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    return None


def find_inputs(inputs: list[str], fmt: str = "auto", pattern: Optional[str] = None) -> list[InputFile]:
    """Every input file, in a stable order: each input in turn, a directory's files sorted by path."""
    out: list[InputFile] = []
    for spec in inputs:
        if os.path.isdir(spec):
            root = Path(spec)
            found = [p for p in (root.glob(pattern) if pattern else root.rglob("*")) if p.is_file()]
            files = sorted(((p.relative_to(root).as_posix(), str(p)) for p in found))
            files = [(n, p) for n, p in files if _kind(p, fmt if pattern else "auto") or pattern]
        elif os.path.isfile(spec):
            files = [(os.path.basename(spec), spec)]
        else:
            matches = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not matches:
                raise MissingInputError(f"input {spec!r}: no such file, directory or matching glob")
            common = os.path.commonpath([os.path.dirname(p) for p in matches])
            files = [(os.path.relpath(p, common), p) for p in matches]
        for name, path in files:
            kind = _kind(path, fmt) or "text"
            if kind not in ("text", "jsonl", "parquet"):
                raise UserError(f"format {fmt!r}: allowed text, jsonl, parquet, auto")
            out.append(InputFile(path, name, kind, os.path.getsize(path)))
    if not out:
        raise MissingInputError(f"inputs {inputs}: no text, JSON-lines or Parquet files found "
                                f"({pattern or '*' + ', *'.join(TEXT_SUFFIXES + JSONL_SUFFIXES + ('.parquet',))})")
    return out


def _open_lines(path: str):
    """A binary stream of the file's (decompressed) bytes."""
    if path.endswith(".gz"):
        import gzip

        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise UserError(f"{path}: a .zst input needs the `zstandard` package: {install_hint('data')}") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def _jsonl_chunks(fi: InputFile, index: int, offset: int, line: int, chunk_bytes: int,
                  max_record: int) -> Iterator[Chunk]:
    with _open_lines(fi.path) as f:
        if offset:
            if fi.path.endswith(COMPRESSED):  # no seeking in a compressed stream: read up to the offset
                left = offset
                while left:
                    left -= len(f.read(min(left, 1 << 24)))
            else:
                f.seek(offset)
        chunk = Chunk("jsonl", [fi.name], [], lines=[])
        start = offset
        while True:
            raw = f.readline(max_record + 1)
            if not raw:
                break
            line += 1
            offset += len(raw)
            if len(raw) > max_record and not raw.endswith(b"\n"):  # a record far larger than the rest
                size = len(raw)
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(max_record + 1)
                    size += len(raw)
                    offset += len(raw)
                chunk.bad.append((f"{fi.name}:{line}", f"a record of {size / 2**20:.1f} MiB, over the limit of "
                                  f"{max_record / 2**20:.1f} MiB (max record size)"))
            elif raw.strip():
                chunk.records.append(raw)
                chunk.lines.append(line)
            if offset - start >= chunk_bytes:
                chunk.end, chunk.bytes = (index, offset, line), offset - start
                yield chunk
                chunk, start = Chunk("jsonl", [fi.name], [], lines=[]), offset
        if offset == 0:
            chunk.bad.append((fi.name, "an empty file"))
        chunk.end, chunk.bytes = (index + 1, 0, 0), offset - start
        yield chunk


def _parquet_chunks(fi: InputFile, index: int, row: int, column: str, chunk_bytes: int) -> Iterator[Chunk]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{fi.path}: a Parquet input needs the `pyarrow` package: {install_hint('data')}") from None
    try:
        pf = pq.ParquetFile(fi.path)
    except Exception as e:  # pyarrow raises its own error types for unreadable files
        yield Chunk("parquet", [fi.name], [], end=(index + 1, 0, 0), bytes=fi.size,
                    bad=[(fi.name, f"not a readable Parquet file ({e})")])
        return
    if column not in pf.schema_arrow.names:
        yield Chunk("parquet", [fi.name], [], end=(index + 1, 0, 0), bytes=fi.size,
                    bad=[(fi.name, f"no column {column!r} (its columns: {', '.join(pf.schema_arrow.names)})")])
        return
    total_rows = max(pf.metadata.num_rows, 1)
    per_row = max(fi.size / total_rows, 1.0)
    rows = max(1, int(chunk_bytes / per_row))
    done = 0
    for batch in pf.iter_batches(batch_size=rows, columns=[column]):
        n = batch.num_rows
        if done + n <= row:  # finished before a resume
            done += n
            continue
        values = batch.column(0).to_pylist()[max(row - done, 0):]
        first = max(row, done) + 1
        done += n
        yield Chunk("parquet", [fi.name], values, first_line=first, end=(index, 0, done),
                    bytes=int(len(values) * per_row))
    yield Chunk("parquet", [fi.name], [], end=(index + 1, 0, 0),
                bad=[(fi.name, "an empty file")] if pf.metadata.num_rows == 0 else [])


def read_chunks(files: list[InputFile], position: tuple = (0, 0, 0), chunk_bytes: int = 4 << 20,
                max_record: int = 64 << 20, column: str = "text") -> Iterator[Chunk]:
    """The inputs from ``position`` = (file index, byte offset, line or row) on, as chunks."""
    index, offset, line = position
    texts = Chunk("text", [], [])
    while index < len(files):
        fi = files[index]
        if fi.kind != "text" and (texts.names or texts.bad):
            texts.end = (index, 0, 0)
            yield texts
            texts = Chunk("text", [], [])
        if fi.kind == "jsonl":
            yield from _jsonl_chunks(fi, index, offset, line, chunk_bytes, max_record)
        elif fi.kind == "parquet":
            yield from _parquet_chunks(fi, index, line, column, chunk_bytes)
        else:
            if fi.size == 0:
                texts.bad.append((fi.name, "an empty file"))
            elif fi.size > max_record:
                texts.bad.append((fi.name, f"a document of {fi.size / 2**20:.1f} MiB, over the limit of "
                                  f"{max_record / 2**20:.1f} MiB (max record size)"))
            else:
                with open(fi.path, "rb") as f:
                    texts.records.append(f.read())
                texts.names.append(fi.name)
            texts.bytes += fi.size
            if texts.bytes >= chunk_bytes:
                texts.end = (index + 1, 0, 0)
                yield texts
                texts = Chunk("text", [], [])
        index, offset, line = index + 1, 0, 0
    if texts.names or texts.bad:
        texts.end = (len(files), 0, 0)
        yield texts
