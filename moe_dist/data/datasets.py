"""Prepared datasets named by path, with weights: what ``data.paths`` reads.

A path is one of

- a directory written by ``moe-dist prepare`` (its ``manifest.json``): training and validation
  documents were split when it was prepared, each shard a training and a validation prefix;
- a Megatron indexed dataset prefix ``P`` (``P.bin`` + ``P.idx``), as Megatron-LM's
  ``tools/preprocess_data.py`` or megatron-core's ``IndexedDatasetBuilder`` write it;
- a directory of such prefixes (their ``.idx`` files, sorted), read as one dataset.

A Megatron prefix has no split of its own: a document is held out for validation when a hash
of its index falls under ``data.val_fraction`` (the same documents on every machine and at
every rank count), unless ``data.valid_paths`` names separate validation data.

The blend is written ``"0.7 A 0.3 B"`` (Megatron's form, one string) or as a list whose items
are ``"A"`` or ``"0.7 A"``; weights are normalised, a missing weight is 1.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np

from ..errors import InputError, MissingInputError
from .indexed import IndexedFile, is_prefix
from .pipeline import FORMAT, MANIFEST, read_record
from .stream import TokenStream


@dataclass
class Source:
    """One dataset of a blend: its training and validation token streams."""

    path: str
    weight: float
    train: TokenStream
    val: TokenStream
    documents: int
    tokenizer_sha256: Optional[str] = None  # known for a prepared directory
    tokenizer_file: Optional[str] = None


def parse_blend(spec: Union[str, list, None]) -> list[tuple[float, str]]:
    """``[(weight, path)]`` from ``"0.7 A 0.3 B"``, ``"A"`` or a list of ``"A"`` / ``"0.7 A"`` items; weights sum to 1."""
    if spec is None or spec == [] or spec == "":
        return []
    items = [spec] if isinstance(spec, str) else list(spec)
    pairs: list[tuple[float, str]] = []
    for item in items:
        words = str(item).split()
        if len(words) == 1:
            pairs.append((1.0, words[0]))
            continue
        if len(words) % 2:
            raise InputError(f"data.paths: {item!r}: expected a path, or weight-path pairs like '0.7 A 0.3 B'")
        for w, p in zip(words[::2], words[1::2]):
            try:
                weight = float(w)
            except ValueError:
                raise InputError(f"data.paths: {item!r}: {w!r} is not a weight (weight-path pairs: '0.7 A 0.3 B')") from None
            if not weight > 0:
                raise InputError(f"data.paths: {item!r}: weight {w} of {p}; allowed: a number > 0")
            pairs.append((weight, p))
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def _hash_fraction(n: int, salt: int) -> np.ndarray:
    """A fixed pseudo-random number in [0, 1) for each of ``n`` document indices (splitmix64)."""
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) + np.uint64(salt) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _runs(tokens: np.ndarray, starts: np.ndarray, ends: np.ndarray, keep: np.ndarray) -> list:
    """The kept documents as ranges of consecutive ones."""
    parts = []
    idx = np.flatnonzero(keep)
    if len(idx) == 0:
        return parts
    breaks = np.flatnonzero(np.diff(idx) != 1)
    firsts = np.concatenate([[idx[0]], idx[breaks + 1]])
    lasts = np.concatenate([idx[breaks], [idx[-1]]])
    for f, last in zip(firsts, lasts):
        parts.append((tokens, int(starts[f]), int(ends[last])))
    return parts


def _megatron_parts(files: list[IndexedFile], val_fraction: float, separate_val: bool) -> tuple[list, list, int]:
    train, val, docs = [], [], 0
    for i, f in enumerate(files):
        starts, ends = f.document_spans()
        held = _hash_fraction(len(starts), i) < (0.0 if separate_val else val_fraction)
        train += _runs(f.tokens, starts, ends, ~held)
        val += _runs(f.tokens, starts, ends, held)
        docs += len(starts)
    return train, val, docs


def check_paths(spec, key: str) -> None:
    """Each path of a blend is a prepared directory, a Megatron prefix or a directory of prefixes (nothing opened)."""
    for _, path in parse_blend(spec):
        if not (os.path.isfile(os.path.join(path, MANIFEST)) or is_prefix(path)
                or (os.path.isdir(path) and glob.glob(os.path.join(path, "*.idx")))):
            raise MissingInputError(f"{key}: {path!r} is neither a prepared directory (manifest.json), a Megatron "
                                    "dataset prefix (PATH.bin + PATH.idx) nor a directory of them")


def open_source(path: str, weight: float = 1.0, val_fraction: float = 0.05, separate_val: bool = False) -> Source:
    if os.path.isfile(os.path.join(path, MANIFEST)):
        m = read_record(os.path.join(path, MANIFEST))
        if m.get("format") != FORMAT:
            raise InputError(f"{path}/{MANIFEST}: format {m.get('format')!r}, expected {FORMAT!r} (re-run moe-dist prepare)")
        train, val = [], []
        for shard in m["shards"]:
            for split, parts in (("train", train), ("val", val)):
                f = IndexedFile(os.path.join(path, shard[split]))
                if f.documents_tokens() != shard[f"{split}_tokens"]:
                    raise InputError(f"{f.prefix}: {f.documents_tokens()} tokens, the manifest says "
                                     f"{shard[split + '_tokens']}; prepare it again")
                span = f.contiguous()
                parts.append((f.tokens, span[0], span[1]))
        tok = m["tokenizer"]
        return Source(path, weight, TokenStream(train), TokenStream(val), m["documents"], tok["sha256"],
                      os.path.join(path, tok["file"]))
    if is_prefix(path):
        files = [IndexedFile(path)]
    elif os.path.isdir(path) and (idx := sorted(glob.glob(os.path.join(path, "*.idx")))):
        files = [IndexedFile(p[:-4]) for p in idx]
    else:
        check_paths(path, "data.paths")
    train, val, docs = _megatron_parts(files, val_fraction, separate_val)
    return Source(path, weight, TokenStream(train), TokenStream(val), docs)


def open_blend(spec, valid_spec=None, val_fraction: float = 0.05) -> tuple[list[Source], list[tuple[float, TokenStream]]]:
    """The training sources of ``data.paths`` and the validation streams with their weights: each
    source's held-out documents, or all of ``data.valid_paths`` when it is set."""
    separate = bool(parse_blend(valid_spec))
    sources = [open_source(p, w, val_fraction, separate) for w, p in parse_blend(spec)]
    for s in sources:
        if s.train.count == 0:
            raise InputError(f"data.paths: {s.path} has no training tokens (all of its {s.documents} documents held "
                             "out for validation?)")
    if separate:
        val = [open_source(p, w, val_fraction, True) for w, p in parse_blend(valid_spec)]
        return sources, [(v.weight, TokenStream(v.train.parts + v.val.parts)) for v in val]
    return sources, [(s.weight, s.val) for s in sources if s.val.count]
