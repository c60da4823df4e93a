"""``train.attention_dtype``: the dtype attention's fused kernel runs in under ``train.dtype=bf16``.

Under bf16 autocast the queries, keys and values come out of their projections in bf16 and torch
runs SDPA in bf16. On some CPUs that is slower than running it on fp32 copies: the CPU
flash-attention kernel accumulates in fp32 either way, and its bf16 backward spends more on
conversions than the bf16 products save at small head sizes (measured: ``bench/results.md``,
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

import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..hardware import synchronize
from ..model.layers import Attention, rotary_tables

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


def probe_layer(like: Attention, device: torch.device, seed: int = 0) -> Attention:
    """A fresh attention layer of ``like``'s shape on ``device`` (random weights): timed in place of
    the model's own, whose weights may be sharded."""
    d_model = like.wq.in_features
    probe = Attention(d_model, like.n_heads, like.n_kv_heads, 0.02, 0.02, qkv_bias=like.wq.bias is not None,
                      qk_norm="projection" if like.q_norm is not None else "none")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in probe.parameters():
            w.copy_(torch.randn(w.shape, generator=gen) * 0.02)
    return probe.to(device)


def time_attention(layer: Attention, batch: int, seq_len: int, device: torch.device, reps: int = REPS,
                   seed: int = 0) -> dict[str, float]:
    """Seconds of one forward + backward of ``layer`` under bf16 autocast as the model runs it
    (fp32 inputs, RoPE), its kernel in bf16 and on fp32 copies (best of ``reps`` alternating
    rounds after a warm-up). The layer's own layouts and casts count: the projections are
    transposed views and RoPE returns fp32 queries and keys, so the bf16 way casts them back."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, layer.wq.in_features, generator=gen).to(device).requires_grad_()
    g = torch.randn(batch, seq_len, layer.wo.out_features, generator=gen).to(device, torch.bfloat16)
    cos, sin = rotary_tables(seq_len, layer.head_dim, 10000.0, device, torch.float32)
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    times = {"bf16": float("inf"), "fp32": float("inf")}
    kept = layer.sdpa_dtype
    try:
        for r in range(reps + 1):
            for name in (times if r % 2 == 0 else reversed(list(times))):
                layer.sdpa_dtype = torch.float32 if name == "fp32" else None
                synchronize(device)
                t0 = clock()
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                    out, _ = layer(x, cos, sin)
                torch.autograd.grad(out, [x, *layer.parameters()], g)
                synchronize(device)
                if r:  # round 0 warms up
                    times[name] = min(times[name], clock() - t0)
    finally:
        layer.sdpa_dtype = kept
    return times


def attention_modules(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


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
        local = times if times is not None else time_attention(probe_layer(a, device), batch, seq_len, device)
        names = sorted(local)
        t = torch.tensor([local[n] for n in names], dtype=torch.float64, device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        slowest = dict(zip(names, t.tolist()))
        chosen = "fp32" if slowest["fp32"] < (1 - MARGIN) * slowest["bf16"] else "bf16"
    for m in layers:
        m.sdpa_dtype = torch.float32 if chosen == "fp32" else None
    return AttentionDecision(chosen, setting, shape, slowest)
