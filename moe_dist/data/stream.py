"""A token stream made of ranges of memory-mapped token files, read as one.

A dataset's training split may be many shards (one file each), or the documents of one file
that are not held out for validation (runs of consecutive documents). :class:`TokenStream`
presents such ranges as one sequence of ``count`` tokens and cuts windows out of it without
loading it: a window that crosses from one range into the next is read piece by piece. The
windows of the next step can be announced to the kernel (:meth:`TokenStream.advise`), so that a
dataset larger than the page cache is read from disk while the current step computes.
"""
from __future__ import annotations

import os

import numpy as np

PAGE = 4096


class TokenStream:
    def __init__(self, parts: list[tuple[np.ndarray, int, int]]):
        """``parts``: (token array, start, end) ranges, in stream order; empty ranges are dropped."""
        self.parts = [(a, int(s), int(e)) for a, s, e in parts if e > s]
        sizes = np.array([e - s for _, s, e in self.parts], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.count = int(self.offsets[-1])

    @classmethod
    def of(cls, tokens: np.ndarray) -> "TokenStream":
        return cls([(tokens, 0, len(tokens))])

    def __len__(self) -> int:
        return self.count

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``start .. start + length`` of the stream, as int64."""
        out = np.empty(length, dtype=np.int64)
        i = int(np.searchsorted(self.offsets, start, side="right")) - 1
        done = 0
        while done < length:
            arr, s, e = self.parts[i]
            lo = s + (start + done - int(self.offsets[i]))
            take = min(e - lo, length - done)
            out[done:done + take] = arr[lo:lo + take]
            done += take
            i += 1
        return out

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``[len(starts), length]`` int64 windows starting at stream positions ``starts``."""
        if len(starts) == 0:
            return np.zeros((0, length), dtype=np.int64)
        if len(self.parts) == 1:
            arr, s, _ = self.parts[0]
            idx = (np.asarray(starts, dtype=np.int64) + s)[:, None] + np.arange(length)[None, :]
            return np.asarray(arr[idx], dtype=np.int64)
        return np.stack([self.read(int(st), length) for st in starts])

    def advise(self, starts, length: int) -> None:
        """Ask the kernel to read the windows at ``starts`` ahead (``posix_fadvise`` WILLNEED on their
        byte ranges): the disk reads overlap the step that runs meanwhile, and nothing waits here."""
        if not hasattr(os, "posix_fadvise"):
            return
        for st in starts:
            i = int(np.searchsorted(self.offsets, st, side="right")) - 1
            done = 0
            while done < length and i < len(self.parts):
                arr, s, e = self.parts[i]
                lo = s + (int(st) + done - int(self.offsets[i]))
                take = min(e - lo, length - done)
                fd = self._fd(arr)
                if fd is not None:
                    first = (arr.offset + lo * arr.itemsize) // PAGE * PAGE
                    os.posix_fadvise(fd, first, arr.offset + (lo + take) * arr.itemsize - first, os.POSIX_FADV_WILLNEED)
                done += take
                i += 1

    def _fd(self, arr):
        """A read-only descriptor of a memory-mapped part's file (kept open), or None for an in-memory array."""
        name = getattr(arr, "filename", None)
        if name is None:
            return None
        fds = self.__dict__.setdefault("_fds", {})
        if name not in fds:
            fds[name] = os.open(name, os.O_RDONLY)
        return fds[name]

    def head(self, n: int) -> np.ndarray:
        """The first ``n`` tokens (or all of them)."""
        return self.read(0, min(n, self.count)) if self.count else np.zeros(0, dtype=np.int64)

    def array(self) -> np.ndarray:
        """The whole stream as one array: a view for one range, else a copy (small streams only)."""
        if len(self.parts) == 1:
            arr, s, e = self.parts[0]
            return arr[s:e]
        return self.head(self.count)
