"""Model FLOPs utilisation (moe_dist/train/observe/mfu.py): the training FLOPs per token of the main job's
model counted by hand from its built weights, and a CPU peak measured for the training dtype."""
import os

import pytest
import torch

from moe_dist.config import load_config
from moe_dist.model import build_model
from moe_dist.model.params import train_flops_per_token
from moe_dist.train.observe.mfu import Utilisation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_training_flops_per_token_of_the_main_job_by_hand():
    cfg = load_config(os.path.join(ROOT, "configs/tiny.yaml"), ["model.vocab_size=4096"])
    model = build_model(cfg.model, 4096, seed=0)
    seq, k = cfg.train.seq_len, cfg.model.moe.top_k
    weights = dict(model.named_parameters())
    per_token_params = 0
    for i in range(cfg.model.n_layers):
        b = f"blocks.{i}."
        per_token_params += sum(weights[b + f"attn.{w}.weight"].numel() for w in ("wq", "wk", "wv", "wo"))
        per_token_params += weights[b + "ffn.router.weight"].numel()
        per_token_params += k * sum(weights[b + f"ffn.experts.{w}"][0].numel() for w in ("w1", "w2", "w3"))
    per_token_params += weights["embed.weight"].numel()  # the tied output head's matmul (the lookup costs none)
    attention = cfg.model.n_layers * 2 * seq * cfg.model.d_model  # QK^T and PV (2 x 2 S d), halved by the mask
    forward = 2 * per_token_params + attention
    assert train_flops_per_token(cfg.model, seq) == 3 * forward


def test_utilisation_on_a_cpu_against_a_measured_matmul():
    cfg = load_config(os.path.join(ROOT, "configs/test.yaml"), [])
    u = Utilisation(cfg.model, 512, cfg.train.seq_len, torch.device("cpu"), "fp32", world_size=2)
    assert u.flops_per_token == train_flops_per_token(load_config(os.path.join(ROOT, "configs/test.yaml"),
                                                                  ["model.vocab_size=512"]).model, cfg.train.seq_len)
    peak = u.peak()
    assert peak > 1e8 and "fp32 1024^3 matmul measured" in u.peak_source
    assert u.achieved(1000.0) == 1000.0 * u.flops_per_token / 2
    assert u.of(1000.0) == pytest.approx(u.achieved(1000.0) / peak)
    assert u.peak() == peak  # measured once


def _peak(rank, world):
    cfg = load_config(os.path.join(ROOT, "configs/test.yaml"), [])
    return Utilisation(cfg.model, 512, cfg.train.seq_len, torch.device("cpu"), "fp32", world).peak()


def test_ranks_take_the_best_ranks_peak():
    from helpers.dist_harness import run_ranks

    peaks = run_ranks(_peak, 2)
    assert peaks[0] == peaks[1] > 1e8
