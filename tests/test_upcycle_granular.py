"""Granular upcycling (arXiv 2410.07524): each dense FFN split into G experts, the upcycled
model computing the dense model's function at step 0 (checked against transformers' dense
Llama), and the config / planner / command-line sides of it."""
import json
import os

import pytest
import torch

from helpers.hf_cases import build_dense, rel_err

pytest.importorskip("transformers")

from moe_dist.cli import main as cli  # noqa: E402
from moe_dist.config import ConfigError, load_config  # noqa: E402
from moe_dist.hf import DenseCheckpoint  # noqa: E402
from moe_dist.hf.export import load_our_model  # noqa: E402
from moe_dist.upcycle import core, upcycle_config, upcycle_model  # noqa: E402
from moe_dist.moe import moe_layers

TOL = 1e-5
MOE = ["model.moe.num_experts=4", "model.moe.top_k=2"]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("llama"))
    hf = build_dense("llama", d)  # intermediate_size 48
    x = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(x).logits
    return d, x, want


@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("router", ["topk", "xmoe"])
def test_granular_upcycling_preserves_the_dense_function(dense, G, router):
    d, x, want = dense
    ckpt = DenseCheckpoint(d)
    # with a gated shared expert and the expert bias too: both start neutral
    cfg = upcycle_config(ckpt.spec, MOE + [f"model.moe.granularity={G}", f"model.moe.router={router}",
                                           "model.moe.shared_d_ff=16", "model.moe.shared_gate=true",
                                           "model.moe.expert_bias=true"])
    m = cfg.model.moe
    assert (m.num_experts, m.top_k, m.d_ff or cfg.model.d_ff, m.granularity) == (4 * G, 2 * G, 48 // G, 1)
    model = upcycle_model(ckpt, cfg).eval()
    with torch.no_grad():
        got = model(x)
    assert rel_err(got, want) <= TOL, (G, router, rel_err(got, want))
    if G > 1:  # each expert is a slice: no single expert is the dense FFN
        w1 = moe_layers(model)[0].experts.w1
        assert w1.shape == (4 * G, 32, 48 // G) and not torch.equal(w1[0], w1[1])


def test_without_virtual_groups_the_function_is_lost(dense, monkeypatch):
    """The control: the same slices with the router's rows left as initialised (no virtual groups)."""
    d, x, want = dense
    ckpt = DenseCheckpoint(d)
    monkeypatch.setattr(core, "virtual_group_router_", lambda router, groups: None)
    model = upcycle_model(ckpt, upcycle_config(ckpt.spec, MOE + ["model.moe.granularity=2"])).eval()
    with torch.no_grad():
        assert rel_err(model(x), want) > 1e-3


def test_granularity_is_refused_where_it_cannot_work(dense):
    ckpt = DenseCheckpoint(dense[0])
    with pytest.raises(ConfigError, match="model.moe.granularity: 5 must divide the dense FFN's intermediate size 48"):
        upcycle_config(ckpt.spec, MOE + ["model.moe.granularity=5"])
    with pytest.raises(ConfigError, match="model.moe.granularity: 2 is not allowed with router 'symphony'"):
        upcycle_config(ckpt.spec, MOE + ["model.moe.granularity=2", "model.moe.router=symphony"])
    with pytest.raises(ConfigError, match="model.moe.d_ff: 16; with model.moe.granularity=2 .* \\(allowed: null or 24\\)"):
        upcycle_config(ckpt.spec, MOE + ["model.moe.granularity=2", "model.moe.d_ff=16"])


def test_upcycle_command_writes_the_expanded_config_and_the_planner_agrees(dense, tmp_path, capsys):
    d, x, want = dense
    out = str(tmp_path / "up")
    assert cli(["upcycle", "--dense", d, "--out", out, *MOE, "model.moe.granularity=2", "model.moe.layers=every_other",
                "model.moe.shared_d_ff=8"]) == 0
    cfg = load_config(os.path.join(out, "config.yaml"))
    assert (cfg.model.moe.num_experts, cfg.model.moe.top_k, cfg.model.moe.d_ff, cfg.model.moe.granularity) == (8, 4, 24, 1)
    info = json.load(open(os.path.join(out, "upcycle.json")))
    assert info["granularity"] == 2 and info["preserves_function"] is True
    model, _, _ = load_our_model(out)
    with torch.no_grad():
        assert rel_err(model(x), want) <= TOL
    from moe_dist.model import count_parameters
    from moe_dist.plan.plan_input import load_plan_input
    from moe_dist.model.params import count_params

    inp = load_plan_input(d, MOE + ["model.moe.granularity=2", "model.moe.layers=every_other", "model.moe.shared_d_ff=8"])
    counts = count_params(inp.model, inp.moe_blocks)
    assert (counts["total"], counts["active"]) == (info["total_params"], info["active_params"])
    assert (info["total_params"], info["active_params"]) == tuple(count_parameters(model)[k] for k in ("total", "active"))
