"""The unigram baseline: token frequencies of the training split (add-one smoothed)."""
from __future__ import annotations

import math

import numpy as np


COUNT_BLOCK = 1 << 22  # tokens counted at a time: the int64 copy bincount makes stays small


def token_counts(tokens, vocab_size: int, limit: int = -1) -> np.ndarray:
    """How often each id occurs among the first ``limit`` tokens (all: -1) of an array or
    :class:`~moe_dist.data.stream.TokenStream`, counted a block at a time."""
    n = len(tokens) if limit < 0 else min(limit, len(tokens))
    read = tokens.read if hasattr(tokens, "read") else (lambda start, k: tokens[start:start + k])
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, n, COUNT_BLOCK):
        block = np.asarray(read(start, min(COUNT_BLOCK, n - start)), dtype=np.int64)
        counts += np.bincount(block, minlength=vocab_size)[:vocab_size]
    return counts


def unigram_log_probs(train_tokens, vocab_size: int, limit: int = -1) -> np.ndarray:
    counts = token_counts(train_tokens, vocab_size, limit).astype(np.float64)
    counts += 1.0
    return np.log(counts / counts.sum())


def unigram_perplexity(log_probs: np.ndarray, targets: np.ndarray) -> float:
    """Perplexity of the unigram model on ``targets`` (any shape of token ids)."""
    targets = np.asarray(targets, dtype=np.int64).reshape(-1)
    if targets.size == 0:
        raise ValueError("no target tokens to evaluate the unigram baseline on")
    return math.exp(-float(log_probs[targets].mean()))


def blend_log_probs(parts: list, vocab_size: int, limit: int = -1) -> np.ndarray:
    """The unigram model of a blend: each source's smoothed frequencies (of its first ``limit``
    tokens), mixed by its weight (``parts``: (weight, tokens)); one source gives
    :func:`unigram_log_probs` exactly."""
    if len(parts) == 1:
        return unigram_log_probs(parts[0][1], vocab_size, limit)
    probs = sum(w * np.exp(unigram_log_probs(t, vocab_size, limit)) for w, t in parts)
    return np.log(probs / probs.sum())
