"""Decoder LM: shapes, causality, attention paths, padding, router context plumbing,
activation checkpointing, initialisation."""
import os

import pytest
import torch
import torch.nn.functional as F

from helpers import probe_router  # noqa: F401  (registers the _test_probe router)

from moe_dist.config import load_config
from moe_dist.model import Attention, apply_rotary, build_model, count_parameters, rotary_tables
from moe_dist.model.layers import SwiGLU
from moe_dist.moe import MoELayer, moe_layers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 512


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: a second thread only adds synchronisation (badly so on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def model_cfg(*overrides):
    return load_config(os.path.join(ROOT, "configs/test.yaml"), list(overrides)).model


def tokens(B=3, S=16, seed=0):
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed))


def test_shapes_parameters_and_tying():
    model = build_model(model_cfg(), VOCAB, seed=0)
    assert model(tokens()).shape == (3, 16, VOCAB)
    assert model.lm_head.weight is model.embed.weight
    unique = {id(p): p.numel() for p in model.parameters()}
    counts = count_parameters(model)
    assert counts["total"] == sum(unique.values())
    per_expert = 3 * 64 * 64
    assert counts["total"] - counts["active"] == 2 * per_expert * (4 - 2)  # 2 MoE layers, 2 of 4 experts idle
    untied = build_model(model_cfg("model.tie_embeddings=false"), VOCAB, seed=0)
    assert count_parameters(untied)["total"] == counts["total"] + VOCAB * 64


@pytest.mark.parametrize("layers,expected", [("every", [0, 1, 2, 3]), ("every_other", [1, 3]), ([0, 2], [0, 2])])
def test_moe_layer_placement(layers, expected):
    model = build_model(model_cfg("model.n_layers=4", f"model.moe.layers={layers}"), VOCAB)
    assert [i for i, b in enumerate(model.blocks) if isinstance(b.ffn, MoELayer)] == expected
    assert all(isinstance(b.ffn, SwiGLU) for i, b in enumerate(model.blocks) if i not in expected)
    assert [m.context.layer_idx for m in moe_layers(model)] == expected


@pytest.mark.parametrize("router", ["topk", "_test_probe"])
def test_causal(router):
    model = build_model(model_cfg(f"model.moe.router={router}"), VOCAB, seed=1)
    x = tokens(2, 20)
    y = x.clone()
    y[:, 12:] = (y[:, 12:] + 7) % VOCAB
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :12], b[:, :12], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_explicit_attention_matches_sdpa_with_gqa():
    torch.manual_seed(0)
    attn = Attention(64, n_heads=8, n_kv_heads=2, init_std=0.1, out_init_std=0.1)
    x = torch.randn(2, 10, 64)
    cos, sin = rotary_tables(10, 8, 10000.0, x.device, x.dtype)
    fused, none = attn(x, cos, sin)
    explicit, captured = attn(x, cos, sin, capture="probs")
    probs = captured.probs
    assert none is None and probs.shape == (2, 8, 10, 10) and probs.dtype == torch.float32
    torch.testing.assert_close(explicit, fused, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 8, 10))
    assert torch.all(probs.triu(1) == 0)


def test_left_padding_mask():
    """Real tokens after left padding see only real tokens: their logits equal the unpadded run."""
    model = build_model(model_cfg(), VOCAB, seed=2)
    real = tokens(1, 12, seed=3)
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), real], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.bool), torch.ones(1, 12, dtype=torch.bool)], dim=1)
    handed = []  # the RouterInputs each MoE layer's forward gets
    hooks = [m.register_forward_pre_hook(lambda mod, args: handed.append(args[1])) for m in moe_layers(model)]
    with torch.no_grad():
        ref = model(real)
        handed.clear()
        out = model(padded, padding_mask=mask)
        assert len(handed) == len(moe_layers(model)) and all(i.padding_mask is mask for i in handed)
        unmasked = model(padded)
    for hook in hooks:
        hook.remove()
    torch.testing.assert_close(out[:, 4:], ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(unmasked[:, 4:], ref, atol=1e-3)


def test_router_context_plumbing():
    probe = build_model(model_cfg("model.n_layers=3", "model.moe.router=_test_probe"), VOCAB, seed=4)
    plain = build_model(model_cfg("model.n_layers=3"), VOCAB, seed=4)
    plain.load_state_dict(probe.state_dict())
    x = tokens(2, 8)
    with torch.no_grad():
        out_probe, out_plain = probe(x), plain(x)
    torch.testing.assert_close(out_probe, out_plain, rtol=1e-5, atol=1e-5)  # explicit path == fused path
    layers = moe_layers(probe)
    for i, layer in enumerate(layers):
        seen = layer.router.seen[-1]
        assert seen["batch_shape"] == (2, 8) and seen["causal"] is True and seen["tokens"] == 16
        if i == 0:
            assert seen["prev_top1"] is None
        else:
            assert torch.equal(seen["prev_top1"], layers[i - 1].last_routing.expert_ids[:, 0])
        probs = seen["attn_probs"]
        assert probs.shape == (2, 4, 8, 8)  # [B, H, S, S], causal rows summing to one
        assert torch.all(probs.triu(1) == 0)
        torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 8))
        assert layer.attention_needs == "probs"
    # layers whose router does not ask keep the fused kernel and get no attention
    handed = []
    for m in moe_layers(plain):
        m.register_forward_pre_hook(lambda mod, args: handed.append(args[1]))
    with torch.no_grad():
        plain(x)
    assert len(handed) == len(moe_layers(plain)) and all(i.attention is None for i in handed)
    assert all(m.attention_needs is None for m in moe_layers(plain))


def test_attention_probs_are_the_blocks_own():
    model = build_model(model_cfg("model.n_layers=1", "model.moe.router=_test_probe"), VOCAB, seed=5)
    x = tokens(1, 6)
    with torch.no_grad():
        model(x)
        h = model.embed(x)
        cos, sin = rotary_tables(6, model.head_dim, 10000.0, h.device, h.dtype)
        _, expected = model.blocks[0].attn(model.blocks[0].attn_norm(h), cos, sin, capture="probs")
    torch.testing.assert_close(moe_layers(model)[0].router.seen[-1]["attn_probs"], expected.probs)


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    for layer in moe_layers(model):
        layer.context.step, layer.context.micro_step, layer.context.seed = 3, 1, 11
    logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    from moe_dist.moe import collect_aux_loss

    (loss + collect_aux_loss(model)).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("router,options", [("noisy_topk", ["model.moe.router_options={init_std: 0.5}"]),
                                            ("_test_probe", ["model.moe.capacity_factor=1.0"])])
def test_activation_checkpointing_gives_the_same_gradients(router, options):
    cfg = model_cfg("model.n_layers=3", f"model.moe.router={router}", *options)
    x = tokens(4, 17, seed=6)
    ref = build_model(cfg, VOCAB, seed=7)
    g_ref = _grads(ref, x)
    ckpt = build_model(cfg, VOCAB, seed=7)
    ckpt.set_activation_checkpointing(True)
    g_ckpt = _grads(ckpt, x)
    assert set(g_ref) == set(g_ckpt) and len(g_ref) > 10
    for name in g_ref:
        torch.testing.assert_close(g_ckpt[name], g_ref[name], rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    if router == "_test_probe":
        for layer in moe_layers(ckpt):  # routed twice (forward + recompute), side effects once
            assert layer.router.invocations == 2 and len(layer.router.seen) == 1
            assert layer.router.seen[0]["step"] == 3 and layer.router.seen[0]["seed"] == 11
        for layer in moe_layers(ref):
            assert layer.router.invocations == 1


def test_initialisation_depends_on_seed_only():
    state = torch.random.get_rng_state()
    a = build_model(model_cfg(), VOCAB, seed=0).state_dict()
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is untouched
    b = build_model(model_cfg(), VOCAB, seed=0).state_dict()
    c = build_model(model_cfg(), VOCAB, seed=1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.ffn.experts.w1"], c["blocks.0.ffn.experts.w1"])


def test_rotary_is_relative():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    cos, sin = rotary_tables(40, 16, 10000.0, "cpu", torch.float32)

    def score(m, n):
        return (apply_rotary(q, cos[m], sin[m]) * apply_rotary(k, cos[n], sin[n])).sum()

    torch.testing.assert_close(score(5, 2), score(33, 30), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_bf16_autocast_forward():
    model = build_model(model_cfg(), VOCAB, seed=8)
    x = tokens(2, 16)
    with torch.no_grad():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(x)
    assert torch.isfinite(low).all()
    assert (low.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_attention_router_reads_scores_and_matches_the_explicit_path():
    """The attention-aware router gets queries/keys (the block keeps SDPA, no [B, H, S, S]
    tensor); forcing the explicit-probabilities form gives the same logits and gradients."""
    cfg = model_cfg("model.n_layers=2", "model.moe.router=attention", "model.moe.layers=every")
    x = tokens(3, 13, seed=8)
    pad = torch.ones(3, 12, dtype=torch.bool)
    pad[1, :4] = False
    results = {}
    for form in ("scores", "probs"):
        model = build_model(cfg, VOCAB, seed=9)
        for layer in moe_layers(model):
            layer.router.attention_needs = form
        handed = []
        moe_layers(model)[0].register_forward_pre_hook(lambda mod, args: handed.append(args[1].attention))
        model.zero_grad(set_to_none=True)
        logits = model(x[:, :-1], padding_mask=pad)
        F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        assert (handed[0].probs is None) == (form == "scores")
        assert handed[0].queries.shape == (3, cfg.n_heads, 12, model.head_dim)
        results[form] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                         [m.last_routing.expert_ids for m in moe_layers(model)])
    (l_s, g_s, ids_s), (l_p, g_p, ids_p) = results["scores"], results["probs"]
    assert all(torch.equal(a, b) for a, b in zip(ids_s, ids_p))
    torch.testing.assert_close(l_s, l_p, rtol=1e-5, atol=1e-5)
    assert set(g_s) == set(g_p)
    for name in g_s:
        torch.testing.assert_close(g_s[name], g_p[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
