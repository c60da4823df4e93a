"""`moe-dist eval --k`: one evaluation per inference k for routers that have one."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "moe_dist.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_eval_at_several_k(tmp_path):
    run_dir = str(tmp_path / "run")
    r = _cli("train", "--config", "configs/test.yaml", "model.moe.router=hyper", "model.moe.router_options.k_max=4",
             f"run.dir={run_dir}", "train.steps=3", "parallel.ep=1")
    assert r.returncode == 0, r.stderr[-2000:]
    r = _cli("eval", "--run-dir", run_dir, "--k", "1,4")
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.load(open(os.path.join(run_dir, "eval_k.json")))
    assert [row["k"] for row in rows] == [1, 4]
    assert rows[0]["val_loss"] != rows[1]["val_loss"]  # k changes the model's function
    bad = _cli("eval", "--run-dir", run_dir, "--k", "0,x")
    assert bad.returncode != 0 and "--k" in bad.stderr


def test_eval_k_refused_for_router_without_inference_k(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("model:\n  moe:\n    router: sinkhorn\nparallel:\n  ep: 1\n")
    r = _cli("eval", "--run-dir", str(run_dir), "--k", "1,2")
    assert r.returncode != 0 and "has no inference k" in r.stderr


# ---- the gate rule at an inference k (every router with one) -----------------------------------

import torch  # noqa: E402

from moe_dist.moe.routers import ROUTERS, build_router, set_inference_k  # noqa: E402
from moe_dist.moe.routers.base import gate_normalization  # noqa: E402
from moe_dist.moe.routing.types import RoutingContext  # noqa: E402

E, D = 8, 16
SMALL = {"hyper": dict(embed_dim=8, hyper_dim=8)}
INFERENCE_K = sorted(n for n, cls in ROUTERS.items() if cls.has_inference_k)


def test_routers_with_an_inference_k():
    assert INFERENCE_K == ["hyper", "noisy_topk", "smoe_dropout", "topk"]


@pytest.mark.parametrize("name", INFERENCE_K)
@pytest.mark.parametrize("normalize", [None, True, False])
@pytest.mark.parametrize("train_k", [1, 2])
def test_gate_at_k1_follows_the_rule_fixed_at_build(name, normalize, train_k):
    """The gates' normalisation is fixed from the training k; an inference k changes only which
    experts are chosen: trained at k = 2 the default gives a gate of 1 at k = 1, trained at k = 1
    the raw top probability at k = 2 (no renormalisation)."""
    torch.manual_seed(0)
    router = build_router(name, D, E, train_k, normalize=normalize, **SMALL.get(name, {}))
    renormalised = (train_k > 1) if normalize is None else normalize
    assert router.normalize is renormalised is gate_normalization(train_k, normalize)
    x = torch.randn(64, D)
    router.eval()
    for k in (1, 2, E):
        set_inference_k(router, k)
        routing = router(x, RoutingContext())
        top = routing.probs.topk(k, dim=-1)
        assert torch.equal(routing.expert_ids.sort(-1).values, top.indices.sort(-1).values)
        expect = top.values / top.values.sum(-1, keepdim=True) if renormalised else top.values
        torch.testing.assert_close(routing.gates.sort(-1).values, expect.sort(-1).values)
        if k == 1:
            assert bool((routing.gates == 1).all()) is renormalised
    set_inference_k(router, None)
    assert router(x, RoutingContext()).top_k == train_k  # back to the trained k


@pytest.mark.parametrize("name", ["hyper", "smoe_dropout"])
def test_k_schedule_keeps_the_rule_of_its_last_k(name):
    """A schedule from k = 1 to 4 renormalises (the rule of k_max) at every step, k = 1 included
    (a gate of 1, as the reference code trains); normalize: false leaves the raw probabilities."""
    x = torch.randn(32, D)
    for normalize, gate_at_1 in ((None, True), (False, False)):
        torch.manual_seed(0)
        router = build_router(name, D, E, 1, k_min=1, k_max=4, k_schedule_steps=10, normalize=normalize,
                              **SMALL.get(name, {}))
        first = router(x, RoutingContext(step=0))
        assert first.top_k == 1 and bool((first.gates == 1).all()) is gate_at_1
        last = router(x, RoutingContext(step=10))
        assert last.top_k == 4
        if gate_at_1:
            torch.testing.assert_close(last.gates.sum(-1), torch.ones(32))
        else:
            assert (last.gates.sum(-1) < 1).all()


def test_eval_k_rejected_with_the_key():
    for bad in (0, E + 1):
        with pytest.raises(ValueError, match=r"model.moe.router_options.eval_k must be an integer in \[1, num_experts=8\]"):
            build_router("topk", D, E, 2, eval_k=bad)
        with pytest.raises(ValueError, match=r"model.moe.router_options.eval_k must be an integer"):
            build_router("hyper", D, E, 2, eval_k=bad, **SMALL["hyper"])
