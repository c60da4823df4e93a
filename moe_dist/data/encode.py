"""A prepare's worker: one chunk of raw records -> validated texts -> token arrays.

Each worker process holds its own tokenizer (:func:`init_worker`) and turns a
:class:`~moe_dist.data.sources.Chunk` into an :class:`Encoded`: the training and validation
documents' tokens (each document followed by the EOS id) as flat arrays with their lengths,
and every record it could not use, named (file and line) with the reason. Parsing JSON here,
not in the main process, keeps the main process free to read and write.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .corpus import is_validation, not_text
from .tokenizer import Tokenizer

_STATE: dict = {}


@dataclass
class Encoded:
    train: tuple  # (tokens, lengths)
    val: tuple
    bad: list = field(default_factory=list)  # (where, why)
    empty: int = 0  # records whose text is empty (kept out: nothing to learn from)
    characters: int = 0


def init_worker(tokenizer_bytes: bytes, field_name: str, val_fraction: float, dtype: str) -> None:
    """Runs once in each worker: the tokenizer, single-threaded (the workers are the parallelism)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _STATE.update(tok=Tokenizer(tokenizer_bytes), field=field_name, val=val_fraction, dtype=np.dtype(dtype))


def _texts(chunk) -> tuple[list, list, list, int]:
    """(names, texts, bad, empty) of the chunk's records."""
    names, texts, bad, empty = [], [], list(chunk.bad), 0
    key = _STATE["field"]
    if chunk.kind == "jsonl":
        fname = chunk.names[0]
        for raw, line in zip(chunk.records, chunk.lines):
            where = f"{fname}:{line}"
            try:
                rec = json.loads(raw)
            except UnicodeDecodeError:
                bad.append((where, "not UTF-8"))
                continue
            except json.JSONDecodeError as e:
                # json's message may end with "at" where it names a position ("Invalid control character at")
                bad.append((where, f"not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})"))
                continue
            if not isinstance(rec, dict) or key not in rec:
                bad.append((where, f"no field {key!r}" + ("" if isinstance(rec, dict) else " (not a JSON object)")))
            elif not isinstance(rec[key], str):
                bad.append((where, f"field {key!r} is {type(rec[key]).__name__}, not a string"))
            elif not rec[key]:
                empty += 1
            else:
                names.append(where)
                texts.append(rec[key])
        bad.sort(key=lambda b: int(b[0].rsplit(":", 1)[1]) if ":" in b[0] else 0)  # in line order
    elif chunk.kind == "parquet":
        fname = chunk.names[0]
        for i, value in enumerate(chunk.records):
            where = f"{fname}:{chunk.first_line + i}"
            if value is None:
                bad.append((where, f"column {key!r} is null"))
            elif not isinstance(value, str):
                bad.append((where, f"column {key!r} is {type(value).__name__}, not a string"))
            elif not value:
                empty += 1
            else:
                names.append(where)
                texts.append(value)
    else:
        for name, data in zip(chunk.names, chunk.records):
            why = not_text(data)
            if why:
                bad.append((name, why))
                continue
            text = data.decode("utf-8", errors="replace")
            if text:
                names.append(name)
                texts.append(text)
            else:
                empty += 1
    return names, texts, bad, empty


def _pack(ids: list, eos: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(x) + 1 for x in ids), dtype=np.int32, count=len(ids))
    flat = np.empty(int(lengths.sum()), dtype=dtype)
    ends = np.cumsum(lengths)
    pos = 0
    for x, end in zip(ids, ends):
        flat[pos:end - 1] = x
        pos = end
    flat[ends - 1] = eos
    return flat, lengths


SUB_BATCH = 64  # documents per tokenizer call: their id lists (and a fast tokenizer's Encoding objects) stay small


def encode_texts(tok: Tokenizer, texts: list, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The documents' tokens, each followed by EOS: (flat tokens, lengths). Encoded a few documents at a
    time and packed into arrays at once, so a chunk's Python id lists never exist all together."""
    if not texts:
        return np.zeros(0, dtype=dtype), np.zeros(0, dtype=np.int32)
    parts = [_pack(tok.encode_batch(texts[i:i + SUB_BATCH], threads=1), tok.eos_id, dtype)
             for i in range(0, len(texts), SUB_BATCH)]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def encode_chunk(chunk, state: Optional[dict] = None) -> Encoded:
    st = state or _STATE
    if state is not None:  # in-process use
        _STATE.update(state)
    names, texts, bad, empty = _texts(chunk)
    split = [is_validation(n, st["val"]) for n in names]
    train = [t for t, v in zip(texts, split) if not v]
    val = [t for t, v in zip(texts, split) if v]
    return Encoded(encode_texts(st["tok"], train, st["dtype"]), encode_texts(st["tok"], val, st["dtype"]), bad, empty,
                   sum(len(t) for t in texts))
