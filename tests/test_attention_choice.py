"""train.attention_dtype (moe_dist/tuning/attention.py): the fused attention kernel run on
fp32 copies under bf16 autocast, and one choice for every rank."""
import pytest
import torch
import torch.nn.functional as F

from helpers.dist_harness import run_ranks
from moe_dist.config import load_config
from moe_dist.model import build_model
from moe_dist.model.layers import Attention, fused_attention
from moe_dist.tuning.attention import decide_attention_dtype, time_attention


def _qkv(dtypes=(torch.bfloat16,) * 3):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, h, 16, 8, generator=g).to(dt).requires_grad_() for h, dt in zip((4, 2, 2), dtypes)]


def test_fp32_attention_under_bf16_autocast_is_the_kernel_on_fp32_copies():
    # RoPE's fp32 tables leave q and k in fp32 and v in bf16: all of them go to the fp32 kernel
    q, k, v = _qkv((torch.float32, torch.float32, torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fused_attention(q, k, v, dtype=torch.float32)
        plain = fused_attention(q, k, v)  # autocast's way: the bf16 kernel
    want = F.scaled_dot_product_attention(q, k, v.float(), is_causal=True, enable_gqa=True)
    assert out.dtype == plain.dtype == torch.bfloat16
    assert torch.equal(out, want.to(torch.bfloat16))
    (g,) = torch.autograd.grad(out.float().sum(), v)
    (g_want,) = torch.autograd.grad(want.to(torch.bfloat16).float().sum(), v)
    assert g.dtype == torch.bfloat16 and torch.equal(g, g_want)
    # without autocast and with inputs already in the dtype, nothing changes
    q, k, v = _qkv((torch.float32,) * 3)
    assert torch.equal(fused_attention(q, k, v, dtype=torch.float32), fused_attention(q, k, v))


def _model():
    cfg = load_config("configs/test.yaml", [])
    return build_model(cfg.model, 64, seed=0)


def test_the_setting_reaches_every_attention_layer():
    model = _model()
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert layers
    assert decide_attention_dtype(model, "fp32", "fp32", 2, 16, torch.device("cpu")) is None  # fp32 training
    assert all(m.sdpa_dtype is None for m in layers)
    d = decide_attention_dtype(model, "fp32", "bf16", 2, 16, torch.device("cpu"))
    assert d.dtype == "fp32" and not d.times and all(m.sdpa_dtype == torch.float32 for m in layers)
    d = decide_attention_dtype(model, "bf16", "bf16", 2, 16, torch.device("cpu"))
    assert d.dtype == "bf16" and all(m.sdpa_dtype is None for m in layers)
    with pytest.raises(ValueError, match="train.attention_dtype.*allowed"):
        decide_attention_dtype(model, "fp16", "bf16", 2, 16, torch.device("cpu"))


def test_auto_takes_fp32_only_when_clearly_faster():
    model = _model()
    d = decide_attention_dtype(model, "auto", "bf16", 2, 16, torch.device("cpu"), times={"bf16": 1.0, "fp32": 0.9})
    assert d.dtype == "fp32" and d.times == {"bf16": 1.0, "fp32": 0.9} and "auto -> fp32" in d.describe()
    d = decide_attention_dtype(model, "auto", "bf16", 2, 16, torch.device("cpu"), times={"bf16": 1.0, "fp32": 0.97})
    assert d.dtype == "bf16"  # within the noise margin: torch's default stays
    layer = next(m for m in model.modules() if isinstance(m, Attention))
    layer.sdpa_dtype = torch.float32
    probe = layer.probe(torch.device("cpu"))
    assert (probe.n_heads, probe.n_kv_heads, probe.head_dim) == (layer.n_heads, layer.n_kv_heads, layer.head_dim)
    times = time_attention(probe, 2, 16, torch.device("cpu"), reps=1)
    assert set(times) == {"bf16", "fp32"} and all(0 < t < 10 for t in times.values())
    assert probe.sdpa_dtype is None and layer.sdpa_dtype == torch.float32  # the probe is left as found; the model untouched


def _decide(rank, world):
    # each rank on its own would choose differently; the slowest rank's times decide for all
    local = [{"bf16": 1.0, "fp32": 0.5}, {"bf16": 1.0, "fp32": 2.0}][rank]
    d = decide_attention_dtype(_model(), "auto", "bf16", 2, 16, torch.device("cpu"), times=local)
    return d.dtype, d.times


def test_every_rank_takes_the_same_choice():
    results = run_ranks(_decide, 2)
    assert results[0] == results[1] == ("bf16", {"bf16": 1.0, "fp32": 2.0})
