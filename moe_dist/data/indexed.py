"""Megatron-Core's indexed dataset format, read and written without megatron-core.

A dataset is a prefix ``P``: ``P.bin`` holds every sequence's tokens back to back, ``P.idx``
the index: the 9-byte magic ``MMIDIDX\\0\\0``, version 1 (u64), the token dtype code (u8), the
sequence count and the document-index count (u64 each), then each sequence's length (int32),
each sequence's byte offset in ``P.bin`` (int64), and the document indices (int64: 0, then the
sequence index that ends each document). Megatron-LM's ``tools/preprocess_data.py``, GPT-NeoX
and megatron-core's ``IndexedDatasetBuilder`` all write this layout, so data prepared by them
trains here as it is, and ours reads back through ``megatron.core.datasets.indexed_dataset``.

We write one sequence per document (the document's tokens and its EOS id); a reader keeps
whatever sequence / document structure the writer chose.
"""
from __future__ import annotations

import os
import struct
from typing import Optional

import numpy as np

from ..errors import InputError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# the dtype codes of the format (megatron.core.datasets.indexed_dataset.DType)
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
UINT16_BELOW = 65500  # the vocabulary size under which the format's writers choose uint16, else int32


def token_dtype(vocab_size: int) -> np.dtype:
    """The token dtype megatron's writers choose for this vocabulary size."""
    return np.dtype(np.uint16) if vocab_size < UINT16_BELOW else np.dtype(np.int32)


class IndexedWriter:
    """Streams documents into ``<path>.bin``; :meth:`finish` writes ``<path>.idx``. Both are written
    under temporary names and renamed into place by :meth:`finish` (``.idx`` last), so a reader never
    sees a half-written pair."""

    def __init__(self, prefix: str, dtype: np.dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        self._bin_tmp = prefix + ".bin.tmp"
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[np.ndarray] = []
        self.tokens = self.documents = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: ``tokens`` is their concatenation, ``lengths`` each one's token count."""
        if len(lengths) == 0:
            return
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        self.tokens += int(tokens.size)
        self.documents += len(lengths)

    def finish(self) -> None:
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.arange(len(lengths) + 1, dtype=np.int64)  # one sequence per document
        idx_tmp = self.prefix + ".idx.tmp"
        with open(idx_tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", CODE_OF[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_idx)))
            f.write(lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(idx_tmp, self.prefix + ".idx")

    def abandon(self) -> None:
        self._bin.close()
        for path in (self._bin_tmp, self.prefix + ".idx.tmp"):
            if os.path.exists(path):
                os.remove(path)


class IndexedFile:
    """One indexed dataset, memory-mapped: its token stream and its documents' token ranges."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx, binp = prefix + ".idx", prefix + ".bin"
        for path in (idx, binp):
            if not os.path.isfile(path):
                raise InputError(f"{path} does not exist (a dataset prefix P names P.bin and P.idx)")
        with open(idx, "rb") as f:
            head = f.read(34)
        if len(head) < 34 or head[:9] != MAGIC:
            raise InputError(f"{idx}: not a Megatron indexed dataset index (no MMIDIDX header)")
        version, code = struct.unpack("<Q", head[9:17])[0], head[17]
        if version != VERSION or code not in DTYPE_CODES:
            raise InputError(f"{idx}: index version {version}, dtype code {code}; this reader knows version 1, "
                             f"codes {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        n_seq, n_doc_idx = struct.unpack("<QQ", head[18:34])
        raw = np.memmap(idx, mode="r", dtype=np.uint8)
        need = 34 + n_seq * 4 + n_seq * 8 + n_doc_idx * 8
        if raw.size < need:
            raise InputError(f"{idx}: {raw.size} bytes, its header promises {need} (truncated?)")
        self.lengths = np.frombuffer(raw, dtype=np.int32, count=n_seq, offset=34)
        self.pointers = np.frombuffer(raw, dtype=np.int64, count=n_seq, offset=34 + 4 * n_seq)
        self.doc_idx = np.frombuffer(raw, dtype=np.int64, count=n_doc_idx, offset=34 + 12 * n_seq)
        size = os.path.getsize(binp)
        end = int(self.pointers[-1]) + int(self.lengths[-1]) * self.dtype.itemsize if n_seq else 0
        if end > size:
            raise InputError(f"{binp}: {size} bytes, its index reaches byte {end} (truncated?)")
        self.tokens = np.memmap(binp, mode="r", dtype=self.dtype, shape=(size // self.dtype.itemsize,)) if size else \
            np.zeros(0, dtype=self.dtype)

    @property
    def num_documents(self) -> int:
        return max(len(self.doc_idx) - 1, 0)

    def documents_tokens(self) -> int:
        """Tokens in the documents' sequences."""
        return int(self.lengths.sum(dtype=np.int64))

    def document_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """Each document's [start, end) in the token stream (a document's sequences lie back to back)."""
        first, last = self.doc_idx[:-1], self.doc_idx[1:] - 1
        starts = self.pointers[first] // self.dtype.itemsize if len(first) else np.zeros(0, dtype=np.int64)
        ends = (self.pointers[last] // self.dtype.itemsize + self.lengths[last]) if len(last) else starts
        return np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)

    def contiguous(self) -> Optional[tuple[int, int]]:
        """(start, end) when the documents fill one gap-free range of the stream, else None."""
        if self.num_documents == 0:
            return (0, 0)
        starts, ends = self.document_spans()
        if np.array_equal(starts[1:], ends[:-1]):
            return int(starts[0]), int(ends[-1])
        return None


def is_prefix(path: str) -> bool:
    return os.path.isfile(path + ".idx") and os.path.isfile(path + ".bin")
