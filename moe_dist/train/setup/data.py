"""The run's data: the prepared token cache (built once per node), the vocabulary the model
gets from it, and a warning when the training split is too small for the run."""
from __future__ import annotations

from typing import Callable

import torch.distributed as dist

from ...config import Config, ConfigError
from ...data import PreparedData, load_datasets, load_prepared, prepare_data
from ...distributed.bootstrap import Runtime


def load_data(cfg: Config, rt: Runtime, log: Callable[[str], None]) -> PreparedData:
    """``data.paths``: the prepared datasets, opened by every process. Else ``data.corpus``: the first
    process of each node builds the cache if needed (atomically); the rest wait."""
    if cfg.data.paths:
        return load_datasets(cfg.data)
    directory = None
    if rt.launch.local_rank == 0:
        directory = prepare_data(cfg.data, log=log)
    if rt.distributed:
        dist.barrier()
    if directory is None:
        directory = prepare_data(cfg.data, log=lambda _: None)  # finds the finished cache
    return load_prepared(directory)


def resolve_vocab(cfg: Config, data: PreparedData) -> int:
    if cfg.model.vocab_size is None:
        cfg.model.vocab_size = data.vocab_size
    elif cfg.model.vocab_size < data.vocab_size:
        raise ConfigError(f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's {data.vocab_size}; "
                          "allowed: null (use the tokenizer's) or at least the tokenizer's size")
    return cfg.model.vocab_size


MIN_STEPS_OF_DATA = 4  # a training set smaller than this many steps' tokens is worth a warning


def small_corpus_note(train_tokens: int, global_batch: int, seq_len: int, steps: int) -> str:
    """A warning when the training split holds fewer than a few steps' tokens ('' otherwise)."""
    per_step = global_batch * seq_len
    if train_tokens >= MIN_STEPS_OF_DATA * per_step:
        return ""
    return (f"warning: data: the training split has {train_tokens:,} tokens, {train_tokens / per_step:.2g} step(s) of "
            f"train.global_batch x train.seq_len = {per_step:,} tokens: every step sees the same text again "
            f"({steps * per_step / max(train_tokens, 1):.1f} epochs over train.steps={steps}); add text to data.corpus "
            "or lower train.global_batch / train.seq_len")
