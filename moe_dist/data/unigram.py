"""The unigram baseline: token frequencies of the training split (add-one smoothed)."""
from __future__ import annotations

import math

import numpy as np


def unigram_log_probs(train_tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size].astype(np.float64)
    counts += 1.0
    return np.log(counts / counts.sum())


def unigram_perplexity(log_probs: np.ndarray, targets: np.ndarray) -> float:
    """Perplexity of the unigram model on ``targets`` (any shape of token ids)."""
    targets = np.asarray(targets, dtype=np.int64).reshape(-1)
    if targets.size == 0:
        raise ValueError("no target tokens to evaluate the unigram baseline on")
    return math.exp(-float(log_probs[targets].mean()))


def blend_log_probs(parts: list, vocab_size: int) -> np.ndarray:
    """The unigram model of a blend: each source's smoothed frequencies, mixed by its weight
    (``parts``: (weight, tokens)); one source gives :func:`unigram_log_probs` exactly."""
    if len(parts) == 1:
        return unigram_log_probs(parts[0][1], vocab_size)
    probs = sum(w * np.exp(unigram_log_probs(t, vocab_size)) for w, t in parts)
    return np.log(probs / probs.sum())
