"""Validation loss / perplexity of the model, and of the unigram baseline on the same tokens."""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ...data import PreparedData, eval_batches, unigram_perplexity
from ...data.unigram import blend_log_probs

UNIGRAM_TOKENS = 50_000_000  # the unigram baseline counts at most this many of each source's first training tokens
from ...hardware import batch_to_device


def autocast(device: torch.device, dtype: str):
    """bf16 autocast for the model's matmuls, or nothing."""
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[np.ndarray], device: torch.device, dtype: str = "fp32",
             dp_group: Optional[dist.ProcessGroup] = None) -> dict:
    """Mean next-token loss over every rank's batches (collective when distributed)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [loss sum, tokens]
    try:
        for batch in batches:
            x = batch_to_device(batch, device)
            with autocast(device, dtype):
                logits = model(x[:, :-1])
            total[0] += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum").double()
            total[1] += x[:, 1:].numel()
    finally:
        model.train(was_training)
    if dp_group is not None and dist.is_initialized():
        dist.all_reduce(total, group=dp_group)
    loss = float(total[0] / total[1])
    return {"loss": loss, "ppl": math.exp(loss), "tokens": int(total[1])}


def validation_batches(data: PreparedData, seq_len: int, eval_cfg, dp_rank: int, dp_size: int) -> list[np.ndarray]:
    return eval_batches(data.val_sources, seq_len, eval_cfg.max_sequences, eval_cfg.batch, dp_rank, dp_size)


def unigram_baseline(data: PreparedData, seq_len: int, eval_cfg) -> dict:
    """The unigram model (training-split frequencies) on exactly the validation targets."""
    targets = np.concatenate([b[:, 1:].reshape(-1) for b in validation_batches(data, seq_len, eval_cfg, 0, 1)])
    parts = [(s.weight, s.train) for s in data.sources]
    ppl = unigram_perplexity(blend_log_probs(parts, data.vocab_size, UNIGRAM_TOKENS), targets)
    return {"loss": math.log(ppl), "ppl": ppl, "tokens": int(targets.size)}


def format_report(val: dict, baseline: dict) -> str:
    return (f"validation perplexity {val['ppl']:.2f} (loss {val['loss']:.4f}) vs unigram baseline perplexity "
            f"{baseline['ppl']:.2f} (loss {baseline['loss']:.4f}) on {val['tokens']:,} validation tokens")
