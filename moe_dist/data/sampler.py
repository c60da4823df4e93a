"""Deterministic, layout-independent batches of token windows, from one stream or a blend.

Each token stream is cut into windows of ``seq_len + 1`` tokens at stride ``seq_len`` (input
and shifted target). Windows are visited in a fresh permutation each epoch, seeded by
(seed, epoch). Step ``s`` uses global windows ``s*G .. s*G+G-1``; micro-batch ``m`` of the step
takes the m-th ``G / grad_accum`` of them, and data-parallel rank ``r`` of ``R`` takes the
contiguous slice :func:`rank_slice` of that micro-batch. Concatenating the ranks' slices
gives exactly the one-process batch, whatever ``R`` is. A blend first decides which source
gives each global window (:class:`TrainSampler`); every rank decides all of a step's windows
the same way. The only state is the number of windows consumed, per source for a blend
(``state_dict`` / ``load_state_dict``): a run resumed at another rank count continues with the
very windows the uninterrupted run would have read.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import CheckpointError, ConfigError, InputError
from .stream import TokenStream


def rank_slice(n: int, rank: int, ranks: int) -> slice:
    """Rank ``rank``'s contiguous share of ``n`` items (sizes differ by at most one)."""
    return slice(rank * n // ranks, (rank + 1) * n // ranks)


def num_windows(n_tokens: int, seq_len: int) -> int:
    return max(0, (n_tokens - 1) // seq_len)


def windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    """``[len(starts), seq_len + 1]`` int64 windows."""
    if len(starts) == 0:
        return np.zeros((0, seq_len + 1), dtype=np.int64)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return np.asarray(tokens[idx], dtype=np.int64)


class TrainSampler:
    """Training batches for one data-parallel rank, from one token stream or a weighted blend.

    A blend decides, for each global window in order, which source gives it: the source whose
    share so far lags its weight most (ties: the first), so after ``n`` windows each source has
    given ``weight * n`` of them, within one. Each source visits its own windows in a fresh
    permutation per epoch (seeded by seed, epoch and the source's place in the blend). The
    state is the count of windows each source has given, the same on every rank."""

    def __init__(self, tokens, seq_len: int, global_batch: int, grad_accum: int, dp_rank: int, dp_size: int,
                 seed: int, weights: Optional[list] = None, names: Optional[list] = None):
        if global_batch % grad_accum:
            raise ConfigError(f"train.grad_accum={grad_accum} must divide train.global_batch={global_batch}")
        streams = tokens if isinstance(tokens, list) else [tokens]
        self.streams = [s if isinstance(s, TokenStream) else TokenStream.of(s) for s in streams]
        self.weights = [float(w) for w in (weights or [1.0] * len(self.streams))]
        self.names = list(names or [f"dataset {i}" for i in range(len(self.streams))])
        self.seq_len = seq_len
        self.global_batch, self.grad_accum = global_batch, grad_accum
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.source_windows = [num_windows(s.count, seq_len) for s in self.streams]
        self.n_windows = sum(self.source_windows)
        for name, n, s in zip(self.names, self.source_windows, self.streams):
            if n < 1:
                raise InputError(f"the training split of {name} has {s.count} tokens, fewer than train.seq_len + 1 = "
                                 f"{seq_len + 1}")
        self.consumed = 0
        self.counts = [0] * len(self.streams)  # windows each source has given
        self._perms: dict = {}
        self._notes: list[str] = []

    @property
    def tokens(self) -> np.ndarray:
        """The one source's tokens (single-source samplers)."""
        return self.streams[0].array()

    @property
    def epoch(self) -> float:
        """Epochs of the most-repeated source."""
        return max(c / n for c, n in zip(self.counts, self.source_windows))

    def epochs(self) -> list[float]:
        return [c / n for c, n in zip(self.counts, self.source_windows)]

    def pop_notes(self) -> list[str]:
        """Lines to log: a source that starts its 2nd, 3rd, 5th, 9th, ... epoch (its data repeat)."""
        notes, self._notes = self._notes, []
        return notes

    def _assign(self, n: int) -> list[tuple[int, int]]:
        """(source, its window count) of the next ``n`` global windows; advances the counts."""
        out = []
        single = len(self.streams) == 1
        for _ in range(n):
            if single:
                d = 0
            else:
                g = self.consumed + len(out) + 1
                lag = [w * g - c for w, c in zip(self.weights, self.counts)]
                d = lag.index(max(lag))
            j = self.counts[d]
            done, pos = divmod(j, self.source_windows[d])
            if done and not pos and not done & (done - 1):  # epochs 2, 3, 5, 9, 17, ...: said, not every one
                self._notes.append(f"data: {self.names[d]} repeats: epoch {done + 1} of its "
                                   f"{self.source_windows[d]:,} windows begins at window {self.consumed + len(out):,}")
            out.append((d, j))
            self.counts[d] += 1
        return out

    def _window(self, d: int, j: int) -> int:
        epoch, pos = divmod(j, self.source_windows[d])
        key = (d, epoch)
        if key not in self._perms:
            self._perms = {k: v for k, v in self._perms.items() if k[0] != d}  # one epoch per source at a time
            seq = [self.seed, epoch] if d == 0 else [self.seed, epoch, d]
            self._perms[key] = np.random.Generator(np.random.PCG64(seq)).permutation(self.source_windows[d])
        return int(self._perms[key][pos])

    def next_step(self) -> list[np.ndarray]:
        """This rank's ``grad_accum`` micro-batches of the next step, each ``[b, seq_len + 1]``."""
        picks = self._assign(self.global_batch)
        batches = []
        for m in range(self.grad_accum):
            mine = self._mine(picks, m)
            rows = np.zeros((len(mine), self.seq_len + 1), dtype=np.int64)
            for d in sorted({d for d, _ in mine}):  # one read per source
                sel = [i for i, (dd, _) in enumerate(mine) if dd == d]
                starts = np.array([self._window(d, mine[i][1]) * self.seq_len for i in sel], dtype=np.int64)
                rows[sel] = self.streams[d].windows(starts, self.seq_len + 1)
            batches.append(rows)
        self.consumed += self.global_batch
        return batches

    def _mine(self, picks: list, m: int) -> list:
        micro = self.global_batch // self.grad_accum
        return picks[m * micro:(m + 1) * micro][rank_slice(micro, self.dp_rank, self.dp_size)]

    def prefetch(self) -> None:
        """Announce this rank's windows of the next step to the kernel (read-ahead, no waiting), without
        moving the position: call it after :meth:`next_step`, before the step computes."""
        counts, notes = list(self.counts), list(self._notes)
        saved = self.consumed
        picks = self._assign(self.global_batch)
        self.counts, self._notes, self.consumed = counts, notes, saved
        for m in range(self.grad_accum):
            for d, j in self._mine(picks, m):
                self.streams[d].advise([self._window(d, j) * self.seq_len], self.seq_len + 1)

    def skip_steps(self, steps: int) -> None:
        """Pass over the windows of the next ``steps`` optimizer steps without reading them."""
        self._assign(steps * self.global_batch)
        self.consumed += steps * self.global_batch

    def state_dict(self) -> dict:
        state = {"consumed": self.consumed, "seed": self.seed, "seq_len": self.seq_len, "n_windows": self.n_windows}
        if len(self.streams) > 1:
            state["blend"] = [{"name": n, "weight": w, "windows": nw, "consumed": c}
                              for n, w, nw, c in zip(self.names, self.weights, self.source_windows, self.counts)]
        return state

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len", "n_windows"):
            if state[key] != getattr(self, key):
                raise CheckpointError(f"sampler state was saved with {key}={state[key]}, this run has {getattr(self, key)}")
        blend = state.get("blend")
        if len(self.streams) > 1 or blend:
            saved = [(b["weight"], b["windows"]) for b in blend or []]
            if saved != list(zip(self.weights, self.source_windows)):
                raise CheckpointError(f"sampler state was saved for a blend of {len(saved)} source(s) with (weight, "
                                      f"windows) {saved}, this run has {list(zip(self.weights, self.source_windows))} "
                                      "(data.paths changed?)")
            self.counts = [int(b["consumed"]) for b in blend]
        else:
            self.counts = [int(state["consumed"])]
        self.consumed = int(state["consumed"])
        self._perms = {}


def eval_batches(tokens, seq_len: int, max_sequences: int, batch: int, dp_rank: int, dp_size: int) -> list[np.ndarray]:
    """The first windows of a split, in order, as global batches of ``batch`` sequences (at most
    ``max_sequences`` in all, full batches only); this rank's slice of each. Every rank gets the
    same number of batches and at least one sequence in each. ``tokens`` is one array or stream,
    or a list of (weight, stream): then each stream gives its first ``weight * max_sequences``
    windows (at least one), in list order."""
    sources = tokens if isinstance(tokens, list) else [(1.0, tokens)]
    sources = [(w, s if isinstance(s, TokenStream) else TokenStream.of(s)) for w, s in sources]
    takes = [min(num_windows(s.count, seq_len), max(1, round(w * max_sequences)) if len(sources) > 1 else max_sequences)
             for w, s in sources]
    n = sum(takes)
    if n >= batch:
        n -= n % batch
    if n < max(1, dp_size):
        total = sum(s.count for _, s in sources)
        raise InputError(f"the validation split has {total} tokens: {n} windows of train.seq_len + 1 = {seq_len + 1}"
                         f" tokens, fewer than the {dp_size} data-parallel ranks need; lower train.seq_len or raise "
                         "data.val_fraction")
    picks = [(s, i) for (_, s), k in zip(sources, takes) for i in range(k)][:n]
    out = []
    for first in range(0, n, batch):
        rows = picks[first:min(first + batch, n)]
        mine = rows[rank_slice(len(rows), dp_rank, dp_size)]
        out.append(np.stack([s.windows(np.array([i * seq_len]), seq_len + 1)[0] for s, i in mine]))
    return out
