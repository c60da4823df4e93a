"""Memory-mapped token files and their manifest.

A prepared data directory holds ``tokenizer.model``, one flat little-endian token file per
split (``train.bin``, ``val.bin``; documents joined with the EOS id) and ``manifest.json``
(source, tokenizer hash, token counts). Readers map the files; nothing is loaded whole.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from ..errors import InputError
from ..safe_io import MIB, UnreadableFile, read_json

MANIFEST = "manifest.json"
FORMAT = "moe_dist.tokens/1"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def write_tokens(path: str, docs: Iterable[list[int]], eos_id: int, dtype: np.dtype) -> tuple[int, int]:
    """Append each document and an EOS; returns (tokens, documents)."""
    n_tok = n_doc = 0
    with open(path, "wb") as f:
        for ids in docs:
            arr = np.asarray(list(ids) + [eos_id], dtype=dtype)
            f.write(arr.tobytes())
            n_tok += arr.size
            n_doc += 1
    return n_tok, n_doc


@dataclass
class TokenFile:
    """One split's tokens, memory-mapped."""

    path: str
    dtype: np.dtype
    count: int

    def array(self) -> np.ndarray:
        if self.count == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.count,))


def write_manifest(directory: str, manifest: dict) -> None:
    with open(os.path.join(directory, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)


def read_manifest(directory: str) -> dict:
    try:
        manifest = read_json(os.path.join(directory, MANIFEST), 16 * MIB)
    except UnreadableFile as e:
        raise InputError(str(e)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise InputError(f"{directory}: manifest format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def open_split(directory: str, manifest: dict, split: str) -> TokenFile:
    info = manifest["splits"][split]
    path = os.path.join(directory, info["file"])
    dtype = np.dtype(manifest["dtype"])
    expected = info["tokens"] * dtype.itemsize
    if os.path.getsize(path) != expected:
        raise InputError(f"{path}: {os.path.getsize(path)} bytes, the manifest says {expected}; delete {directory} to rebuild")
    return TokenFile(path, dtype, info["tokens"])
