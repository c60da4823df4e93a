"""``train.attention_dtype``: the dtype attention's fused kernel runs in under ``train.dtype=bf16``.

Under bf16 autocast the queries, keys and values come out of their projections in bf16 and torch
runs SDPA in bf16. On some CPUs that is slower than running it on fp32 copies: the CPU
flash-attention kernel accumulates in fp32 either way, and its bf16 backward spends more on
conversions than the bf16 products save at small head sizes (measured: ``benchmarks/results/training.md``,
"The bf16 gap op by op"). fp32 attention is also the more precise of the two; the output
goes back to bf16 for the output projection.

- ``bf16``: torch's default; ``fp32``: always the fp32 copies;
- ``auto`` (the default): before the first step every rank times one forward + backward of an
  attention layer of the model's shape both ways on one micro-batch (this rank's sequences, the
  sequence length; the projections, RoPE and the casts included, which decide it as much as the
  kernel does), the times are reduced with MAX over the ranks (one all-reduce), and every rank
  takes fp32 only when it is faster by more than :data:`MARGIN`, so all ranks run the same
  kernel. On CPU the time is CPU time; elsewhere synchronised wall time.

Nothing changes under ``train.dtype=fp32``, or for a router that computes the attention
probabilities itself (``capture="probs"``). ``moe-dist eval`` applies the same setting, timed at
its own batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .timing import best_times, slowest_over_ranks

CHOICES = ("auto", "bf16", "fp32")
MARGIN = 0.05  # fp32 is taken only when faster by more than this (noise)
REPS = 3  # timed rounds after a warm-up, both ways alternating; the best of each


@dataclass
class AttentionDecision:
    dtype: str  # "bf16" or "fp32": what the fused kernel runs in
    setting: str  # train.attention_dtype
    shape: tuple  # (sequences, heads, kv heads, sequence length, head size) timed; () when not timed
    times: dict  # "bf16" / "fp32" -> seconds, the slowest rank's

    def describe(self) -> str:
        if not self.times:
            return f"attention runs in {self.dtype} (train.attention_dtype={self.setting})"
        b, h, kv, s, hd = self.shape
        timed = ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in self.times.items())
        return (f"attention auto -> {self.dtype} (an attention layer of {h} heads ({kv} kv) x {hd} on {b} x {s} tokens, "
                f"forward + backward; slowest rank's time: {timed})")


class TimedAttention:
    """What an attention layer whose fused kernel's dtype is chosen here provides (a base of
    ``moe_dist.model.layers.Attention``): ``sdpa_dtype`` (None: its inputs' dtype; ``torch.float32``:
    fp32 copies), ``n_heads``, ``n_kv_heads``, ``head_dim``, and the two calls the timing needs."""

    sdpa_dtype: Optional[torch.dtype]

    def probe(self, device: torch.device, seed: int = 0) -> "TimedAttention":
        """A fresh layer of this one's shape on ``device`` (random weights): timed in place of the
        model's own, whose weights may be sharded."""
        raise NotImplementedError

    def timing_step(self, batch: int, seq_len: int, device: torch.device, seed: int = 0) -> Callable[[], None]:
        """One forward + backward of this layer under bf16 autocast as the model runs it, as a call."""
        raise NotImplementedError


def time_attention(layer: TimedAttention, batch: int, seq_len: int, device: torch.device, reps: int = REPS,
                   seed: int = 0) -> dict[str, float]:
    """Seconds of one forward + backward of ``layer`` under bf16 autocast as the model runs it
    (:meth:`TimedAttention.timing_step`: its own layouts and casts count), its kernel in bf16 and on
    fp32 copies (best of ``reps`` alternating rounds after a warm-up, :func:`~.timing.best_times`)."""
    step = layer.timing_step(batch, seq_len, device, seed)
    kept = layer.sdpa_dtype

    def way(dtype: Optional[torch.dtype]) -> Callable[[], None]:
        def run() -> None:
            layer.sdpa_dtype = dtype
            step()
        return run

    try:
        return best_times({"bf16": way(None), "fp32": way(torch.float32)}, device, reps, alternate=True)
    finally:
        layer.sdpa_dtype = kept


def attention_modules(model: nn.Module) -> list[TimedAttention]:
    return [m for m in model.modules() if isinstance(m, TimedAttention)]


def decide_attention_dtype(model: nn.Module, setting: str, train_dtype: str, batch: int, seq_len: int,
                           device: torch.device, group: Optional[dist.ProcessGroup] = None,
                           times: Optional[dict[str, float]] = None) -> Optional[AttentionDecision]:
    """Set the dtype of every attention layer's fused kernel for ``train.attention_dtype=setting``
    (None and nothing set under fp32 training or without attention). ``auto`` times on every rank
    of ``group`` (default: all, when a process group is initialised; all must call this alike);
    ``times`` replaces this rank's timing (tests)."""
    if setting not in CHOICES:
        raise ValueError(f"train.attention_dtype: {setting!r}; allowed: {list(CHOICES)}")
    layers = attention_modules(model)
    if train_dtype != "bf16" or not layers:
        return None
    shape: tuple = ()
    slowest: dict = {}
    chosen = setting
    if setting == "auto":
        a = layers[0]
        shape = (batch, a.n_heads, a.n_kv_heads, seq_len, a.head_dim)
        local = times if times is not None else time_attention(a.probe(device), batch, seq_len, device)
        slowest = slowest_over_ranks(local, device, group)
        chosen = "fp32" if slowest["fp32"] < (1 - MARGIN) * slowest["bf16"] else "bf16"
    for m in layers:
        m.sdpa_dtype = torch.float32 if chosen == "fp32" else None
    return AttentionDecision(chosen, setting, shape, slowest)
