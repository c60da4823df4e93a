"""The token-graph probe (moe_dist.study.graph_probe): the dense mixing weights agree with the
blockwise mixing step, and the probe's statistics match graphs whose weights are known."""
import os

import pytest
import torch

from moe_dist.config import load_config
from moe_dist.model import build_model
from moe_dist.moe.routers.graph_mixing import dense_graph_weights, mix_over_sequence
from moe_dist.study.graph_probe import format_probe, probe_token_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, B, S = 512, 3, 40


def _model(*overrides):
    cfg = load_config(os.path.join(ROOT, "configs", "test.yaml"), ["parallel.ep=1", *overrides])
    return build_model(cfg.model, VOCAB, seed=3), cfg


def _tokens(seed=0):
    return [torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed + i)) for i in range(2)]


@pytest.mark.parametrize("causal", [True, False])
def test_dense_weights_reproduce_the_mixing_step(causal):
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(2, 300, 6, generator=g), -1)
    q, k = torch.randn(2, 300, 16, generator=g), torch.randn(2, 300, 16, generator=g)
    bias = torch.randn(2, 300, generator=g)
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[1, 250:] = False
    W = dense_graph_weights(q, k, 0.5, key_bias=bias, key_mask=mask, causal=causal)
    assert torch.allclose(W.sum(-1), torch.ones(2, 300), atol=1e-5)
    if causal:
        assert (W.triu(1) == 0).all()
    mixed = mix_over_sequence(probs, q, k, scale=0.5, key_bias=bias, padding_mask=mask, causal=causal)
    torch.testing.assert_close(W @ probs, mixed, atol=1e-5, rtol=1e-4)


def test_sharp_graph_keeps_each_token_to_itself():
    model, _ = _model('model.moe.router="similarity"', "model.moe.router_options.temperature=1e-4")
    results = probe_token_graph(model, _tokens())
    assert len(results) == 2
    for r in results:
        assert r["self"] > 0.999 and r["effective_keys"] < 1.01 and r["top1_changed"] == 0.0
        assert r["load_cv_base"] == pytest.approx(r["load_cv_mixed"]) and r["tokens"] == 2 * B * S
        assert "heads" not in r


def test_flat_graph_averages_the_causal_prefix():
    model, _ = _model('model.moe.router="similarity"', "model.moe.router_options.temperature=1e8")
    r = probe_token_graph(model, _tokens())[0]
    i = torch.arange(S, dtype=torch.float64)
    assert r["self"] == pytest.approx(float((1 / (i + 1)).mean()), rel=1e-4)
    assert r["first"] == pytest.approx(float((1 / (i[1:] + 1)).mean()), rel=1e-4)
    assert r["previous"] == pytest.approx(r["first"], rel=1e-4)
    assert r["effective_keys"] == pytest.approx(float((i + 1).mean()), rel=1e-4)
    assert r["top1_changed"] > 0.1  # averaging over the prefix moves many tokens' first choice


def test_attention_router_reports_its_heads_and_topk_has_nothing_to_probe():
    model, cfg = _model('model.moe.router="attention"')
    results = probe_token_graph(model, _tokens())
    for r in results:
        assert sum(r["heads"]) == 2 * B and len(r["heads"]) == cfg.model.n_heads
        assert 0 < r["self"] <= 1 and 1 <= r["effective_keys"] <= S
    assert "heads" in format_probe(results) and model.training  # left in its mode
    plain, _ = _model()
    assert probe_token_graph(plain, _tokens()) == [None, None]


@pytest.mark.slow
def test_probe_command_on_a_trained_run(tmp_path):
    """`python -m moe_dist.commands.graph_probe --run-dir DIR`: a real run's checkpoint, the table and
    its JSON; a directory that is not a run is one line with exit code 2."""
    import json
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)

    run_dir = str(tmp_path / "run")
    r = cli("moe_dist.cli", "train", "--config", "configs/test.yaml", 'model.moe.router="attention"',
            f"run.dir={run_dir}", "train.steps=2", "parallel.ep=1")
    assert r.returncode == 0, r.stderr[-2000:]
    r = cli("moe_dist.commands.graph_probe", "--run-dir", run_dir, "--sequences", "16", "--json", str(tmp_path / "p.json"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "router attention, checkpoint step 2, 16 sequences of 64 tokens" in r.stdout
    layers = json.load(open(tmp_path / "p.json"))["layers"]
    assert len(layers) == 2 and all(sum(layer["heads"]) == 16 for layer in layers)
    bad = cli("moe_dist.commands.graph_probe", "--run-dir", str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.strip().endswith("(is it a moe-dist run directory?)"), bad.stderr
