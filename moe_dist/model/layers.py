"""Building blocks of the decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..checks import check_choice
from ..moe.routing.types import ATTENTION_NEEDS, AttentionInputs
from ..tuning.attention import TimedAttention


QK_NORMS = ("none", "projection")  # model.qk_norm: where Attention normalises queries and keys


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def scale_rope_frequencies(inv_freq: torch.Tensor, scaling: dict, seq_len: int) -> torch.Tensor:
    """RoPE frequency scaling of long-context checkpoints: ``linear`` (all frequencies / factor),
    ``llama3`` (Llama 3.1+: low frequencies / factor, high ones kept, a smooth ramp between,
    set by the wavelength relative to the original context) or ``longrope`` (Phi-3-128k /
    Phi-3.5: per-frequency divisors, the long set beyond the original context)."""
    kind = scaling["type"]
    if kind == "longrope":
        long = seq_len > scaling["original_max_position_embeddings"]
        ext = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=inv_freq.dtype, device=inv_freq.device)
        return inv_freq / ext
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    ramp = ((context / wavelen - low) / (high - low)).clamp(0.0, 1.0)  # 0: long wavelengths, 1: short ones
    return (1 - ramp) * inv_freq / factor + ramp * inv_freq


def rotary_tables(seq_len: int, head_dim: int, theta: float, device, dtype,
                  scaling: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[seq_len, head_dim]`` for the rotate-half formulation (computed in fp32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling:
        inv_freq = scale_rope_frequencies(inv_freq, scaling, seq_len)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    mscale = float(scaling.get("attention_factor", 1.0)) if scaling else 1.0  # longrope scales cos and sin
    return (angles.cos() * mscale).to(dtype), (angles.sin() * mscale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, H, S, hd]``; rotates pairs (i, i + hd/2) by the position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _init_linear(layer: nn.Linear, std: float) -> nn.Linear:
    layer.init_std = std  # the recipe, for moe_dist.model.init (which fills layers built on the meta device)
    nn.init.normal_(layer.weight, std=std)
    if layer.bias is not None:
        nn.init.zeros_(layer.bias)
    return layer


class Attention(nn.Module, TimedAttention):
    """Causal grouped-query attention: ``n_heads`` query heads share ``n_kv_heads`` key/value heads.

    ``forward`` returns the output and, when asked (``capture``, one of
    :data:`~moe_dist.moe.routing.types.ATTENTION_NEEDS`), an :class:`~moe_dist.moe.routing.types.AttentionInputs`
    for a router that reads the attention: ``scores`` gives the rotated queries and keys, the
    values, the output and the output projection's weight, and the fused SDPA kernel still runs;
    ``probs`` also the probabilities ``[B, H, S, S]``, whose scores and softmax are then computed
    explicitly.

    ``qk_norm="projection"``: RMSNorm over the whole query projection (all heads) and over the
    whole key projection, before RoPE (OLMoE's q/k norm); ``"none"``: no such norm.

    ``sdpa_dtype``: the dtype the fused SDPA kernel runs in when its inputs come in another one
    (None: theirs). Under bf16 autocast, ``torch.float32`` computes attention from fp32 copies of
    the bf16 queries, keys and values and returns bf16: on CPUs whose bf16 flash-attention
    backward is slower than fp32's (``train.attention_dtype``, :mod:`moe_dist.tuning.attention`).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, init_std: float, out_init_std: float,
                 qkv_bias: bool = False, qk_norm: str = "none", norm_eps: float = 1e-5):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        check_choice("model.qk_norm", qk_norm, QK_NORMS)
        self.q_norm = RMSNorm(n_heads * self.head_dim, norm_eps) if qk_norm == "projection" else None
        self.k_norm = RMSNorm(n_kv_heads * self.head_dim, norm_eps) if qk_norm == "projection" else None
        self.wq = _init_linear(nn.Linear(d_model, n_heads * self.head_dim, bias=qkv_bias), init_std)
        self.wk = _init_linear(nn.Linear(d_model, n_kv_heads * self.head_dim, bias=qkv_bias), init_std)
        self.wv = _init_linear(nn.Linear(d_model, n_kv_heads * self.head_dim, bias=qkv_bias), init_std)
        self.wo = _init_linear(nn.Linear(n_heads * self.head_dim, d_model, bias=False), out_init_std)
        self.sdpa_dtype: Optional[torch.dtype] = None

    def probe(self, device: torch.device, seed: int = 0) -> "Attention":
        """A fresh attention layer of this one's shape on ``device`` (random weights)."""
        probe = Attention(self.wq.in_features, self.n_heads, self.n_kv_heads, 0.02, 0.02,
                          qkv_bias=self.wq.bias is not None, qk_norm="projection" if self.q_norm is not None else "none")
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for w in probe.parameters():
                w.copy_(torch.randn(w.shape, generator=gen) * 0.02)
        return probe.to(device)

    def timing_step(self, batch: int, seq_len: int, device: torch.device, seed: int = 0):
        """One forward + backward under bf16 autocast as the model runs it (fp32 inputs, RoPE), as a
        call: the projections are transposed views and RoPE returns fp32 queries and keys, so the
        bf16 kernel casts them back; those casts count in the timing (:mod:`moe_dist.tuning.attention`)."""
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(batch, seq_len, self.wq.in_features, generator=gen).to(device).requires_grad_()
        g = torch.randn(batch, seq_len, self.wo.out_features, generator=gen).to(device, torch.bfloat16)
        cos, sin = rotary_tables(seq_len, self.head_dim, 10000.0, device, torch.float32)

        def step() -> None:
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                out, _ = self(x, cos, sin)
            torch.autograd.grad(out, [x, *self.parameters()], g)
        return step

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, padding_mask: Optional[torch.Tensor] = None,
                capture: Optional[str] = None) -> tuple[torch.Tensor, Optional[AttentionInputs]]:
        if capture is not None and capture not in ATTENTION_NEEDS:  # a router's declaration, not a user's value
            raise ValueError(f"Attention: capture={capture!r}; allowed: None or one of {list(ATTENTION_NEEDS)}")
        B, S, _ = x.shape
        q, k = self.wq(x), self.wk(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        mask = None
        if padding_mask is not None:  # a query sees earlier real keys, and always itself
            causal = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
            eye = torch.eye(S, dtype=torch.bool, device=x.device)
            mask = (causal & padding_mask[:, None, None, :].bool()) | eye
        probs = None
        if capture == "probs":
            groups = self.n_heads // self.n_kv_heads
            k_all, v_all = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            if mask is None:
                mask = torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
            with torch.autocast(device_type=x.device.type, enabled=False):  # probabilities in fp32
                scores = (q.float() @ k_all.float().transpose(-1, -2)) / math.sqrt(self.head_dim)
                probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
            out = probs.to(v_all.dtype) @ v_all
        else:
            out = fused_attention(q, k, v, mask, self.sdpa_dtype)
        h = self.wo(out.transpose(1, 2).reshape(B, S, -1))
        if capture is None:
            return h, None
        # attention-aware routing reads the (un-repeated) keys and values
        return h, AttentionInputs(queries=q, keys=k, values=v, output=h, out_weight=self.wo.weight, probs=probs)


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                    dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """torch's fused SDPA kernel, grouped-query: causal, or under ``mask``. ``dtype``: run it in
    that dtype, whatever the inputs' dtypes and autocast's (which would otherwise cast them all
    to its own: RoPE's fp32 tables leave the queries and keys in fp32, the values in bf16), the
    output in the dtype it would otherwise have."""
    def run(q, k, v):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    device = q.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
    if dtype is None or (out_dtype == dtype and q.dtype == k.dtype == v.dtype == dtype):
        return run(q, k, v)
    with torch.autocast(device_type=device, enabled=False):
        return run(q.to(dtype), k.to(dtype), v.to(dtype)).to(out_dtype)


class SwiGLU(nn.Module):
    """Dense feed-forward layer ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, d_model: int, d_ff: int, init_std: float, out_init_std: float):
        super().__init__()
        self.w1 = _init_linear(nn.Linear(d_model, d_ff, bias=False), init_std)
        self.w3 = _init_linear(nn.Linear(d_model, d_ff, bias=False), init_std)
        self.w2 = _init_linear(nn.Linear(d_ff, d_model, bias=False), out_init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
