"""Deterministic, layout-independent batches of token windows.

The token stream is cut into windows of ``seq_len + 1`` tokens at stride ``seq_len`` (input
and shifted target). Windows are visited in a fresh permutation each epoch, seeded by
(seed, epoch). Step ``s`` uses global windows ``s*G .. s*G+G-1``; micro-batch ``m`` of the step
takes the m-th ``G / grad_accum`` of them, and data-parallel rank ``r`` of ``R`` takes the
contiguous slice :func:`rank_slice` of that micro-batch. Concatenating the ranks' slices
gives exactly the one-process batch, whatever ``R`` is, and the only state is the number of
windows consumed (``state_dict`` / ``load_state_dict``).
"""
from __future__ import annotations

import numpy as np

from ..errors import CheckpointError, ConfigError, InputError


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
    """Training batches for one data-parallel rank."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, grad_accum: int, dp_rank: int, dp_size: int,
                 seed: int):
        if global_batch % grad_accum:
            raise ConfigError(f"train.grad_accum={grad_accum} must divide train.global_batch={global_batch}")
        self.tokens, self.seq_len = tokens, seq_len
        self.global_batch, self.grad_accum = global_batch, grad_accum
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.n_windows = num_windows(len(tokens), seq_len)
        if self.n_windows < 1:
            raise InputError(f"the training split has {len(tokens)} tokens, fewer than train.seq_len + 1 = {seq_len + 1}")
        self.consumed = 0
        self._epoch, self._perm = -1, None

    @property
    def epoch(self) -> float:
        return self.consumed / self.n_windows

    def _window_ids(self, global_ids: np.ndarray) -> np.ndarray:
        out = np.empty_like(global_ids)
        for i, g in enumerate(global_ids):
            epoch, pos = divmod(int(g), self.n_windows)
            if epoch != self._epoch:
                self._epoch = epoch
                self._perm = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.n_windows)
            out[i] = self._perm[pos]
        return out

    def next_step(self) -> list[np.ndarray]:
        """This rank's ``grad_accum`` micro-batches of the next step, each ``[b, seq_len + 1]``."""
        micro = self.global_batch // self.grad_accum
        batches = []
        for m in range(self.grad_accum):
            first = self.consumed + m * micro
            mine = np.arange(first, first + micro)[rank_slice(micro, self.dp_rank, self.dp_size)]
            batches.append(windows(self.tokens, self._window_ids(mine) * self.seq_len, self.seq_len))
        self.consumed += self.global_batch
        return batches

    def skip_steps(self, steps: int) -> None:
        """Pass over the windows of the next ``steps`` optimizer steps without reading them."""
        self.consumed += steps * self.global_batch

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "seq_len": self.seq_len, "n_windows": self.n_windows}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "seq_len", "n_windows"):
            if state[key] != getattr(self, key):
                raise CheckpointError(f"sampler state was saved with {key}={state[key]}, this run has {getattr(self, key)}")
        self.consumed = int(state["consumed"])


def eval_batches(tokens: np.ndarray, seq_len: int, max_sequences: int, batch: int, dp_rank: int, dp_size: int) -> list[np.ndarray]:
    """The first windows of a split, in order, as global batches of ``batch`` sequences (at most
    ``max_sequences`` in all, full batches only); this rank's slice of each. Every rank gets the
    same number of batches and at least one sequence in each."""
    n = min(num_windows(len(tokens), seq_len), max_sequences)
    if n >= batch:
        n -= n % batch
    if n < max(1, dp_size):
        raise InputError(f"the validation split has {len(tokens)} tokens: {n} windows of train.seq_len + 1 = {seq_len + 1}"
                         f" tokens, fewer than the {dp_size} data-parallel ranks need; lower train.seq_len or raise "
                         "data.val_fraction")
    out = []
    for first in range(0, n, batch):
        ids = np.arange(first, min(first + batch, n))
        out.append(windows(tokens, ids[rank_slice(len(ids), dp_rank, dp_size)] * seq_len, seq_len))
    return out
