"""Node-limited (group-limited) routing: ``model.moe.router_groups`` / ``max_groups_per_token``.

A plain-Python reference of the group rule against ``select_topk``; no token's experts span more
than M groups for every router that supports it (with and without the expert bias, along a k
schedule), the layer's statistics and the step metrics report the spans; 1 process vs 2 and 4 gloo
ranks (the features test adds a grouped case with the expert bias and the sequence loss); refusals
name the key; a short training run logs the spans and keeps the setting in its config; the
start-up warning when groups do not sit on nodes."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers.dist_harness import run_ranks
from helpers.router_cases import SPAWN, build_jobs, check_calls, per_job, reference_calls, run_layouts
from moe_dist.config import ConfigError, load_config
from moe_dist.distributed.topology import NodeLayout
from moe_dist.moe import MoEArgs, MoELayer
from moe_dist.moe.routers import ROUTERS
from moe_dist.moe.routers.base import select_topk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E, G, M = 8, 4, 2  # two experts per group; tokens at k=3 must take them from 2 of the 4 groups
SUPPORTED = ["ac", "attention", "hyper", "noisy_topk", "similarity", "smoe_dropout", "topk", "xmoe"]
REFUSED = ["sinkhorn", "ssr", "symphony"]


# ---- the rule, token by token ------------------------------------------------------------------
def reference_choice(scores, probs, bias, k, groups, max_groups, normalize):
    """Per token, in plain Python: group score = sum of the group's top max(1, k // M) selection
    scores (probs, or probs + bias); keep the M best groups; top-k of the choice scores inside them;
    gates = the chosen probs (renormalised)."""
    per = scores.shape[1] // groups
    ids_out, gates_out = [], []
    for t in range(scores.shape[0]):
        p = probs[t].tolist()
        sel = [p[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(len(p))]
        choose_by = sel if bias is not None else scores[t].tolist()
        group_score = [sum(sorted(sel[g * per:(g + 1) * per], reverse=True)[:max(1, k // max_groups)])
                       for g in range(groups)]
        kept = sorted(range(groups), key=lambda g: -group_score[g])[:max_groups]
        allowed = [e for e in range(len(p)) if e // per in kept]
        ids = sorted(allowed, key=lambda e: -choose_by[e])[:k]
        gates = [p[e] for e in ids]
        if normalize:
            gates = [g / sum(gates) for g in gates]
        ids_out.append(ids)
        gates_out.append(gates)
    return torch.tensor(ids_out), torch.tensor(gates_out, dtype=probs.dtype)


@pytest.mark.parametrize("k,groups,max_groups,with_bias", [
    (3, 4, 2, False), (3, 4, 2, True), (4, 4, 2, False), (2, 4, 1, True), (2, 4, 1, False), (5, 8, 3, True),
    (6, 2, 1, False),
])
def test_select_topk_matches_a_loop_reference(k, groups, max_groups, with_bias):
    num_experts = 16 if groups == 8 else (12 if groups == 2 else E)
    g = torch.Generator().manual_seed(k * 100 + groups * 10 + max_groups)
    logits = torch.randn(64, num_experts, generator=g, dtype=torch.float64) * 2
    probs = torch.softmax(logits, -1)
    bias = (torch.randn(num_experts, generator=g) * 0.05).float() if with_bias else None
    ids, gates = select_topk(logits, probs, k, True, bias, (groups, max_groups))
    ref_ids, ref_gates = reference_choice(logits, probs, bias, k, groups, max_groups, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(gates, ref_gates, rtol=1e-12, atol=0)
    spans = (ids // (num_experts // groups)).tolist()
    assert max(len(set(row)) for row in spans) <= max_groups
    # the limit changed some tokens' choice (else this would not test it)
    free_ids, _ = select_topk(logits, probs, k, True, bias)
    assert not torch.equal(free_ids, ids)


def test_group_scores_rank_selection_scores_not_logits():
    """Group 0 holds the single best expert, group 1 two good ones: with k=2, M=1 the group score is
    the sum of the top-2 probabilities, so group 1 wins though group 0 has the top logit."""
    probs = torch.tensor([[0.40, 0.00, 0.30, 0.30]])
    ids, gates = select_topk(probs.log(), probs, 2, False, None, (2, 1))
    assert sorted(ids[0].tolist()) == [2, 3] and gates[0].tolist() == pytest.approx([0.30, 0.30])
    bias = torch.tensor([0.0, 0.25, 0.0, 0.0])  # the bias lifts group 0 above group 1: 0.65 > 0.6
    ids, gates = select_topk(probs.log(), probs, 2, False, bias, (2, 1))
    assert ids[0].tolist() == [0, 1] and gates[0].tolist() == pytest.approx([0.40, 0.00])  # the unbiased probs


def test_select_topk_refuses_a_k_that_does_not_fit():
    probs = torch.softmax(torch.randn(3, E), -1)
    with pytest.raises(ValueError, match="k=5 experts per token do not fit in max_groups_per_token=2"):
        select_topk(probs, probs, 5, True, None, (G, M))


# ---- every supported router, through a model ---------------------------------------------------
ROUTER_ARGS = {
    "ac": ["model.moe.router_options={start_layer: 1}"],
    "hyper": ["model.moe.router_options={k_min: 1, k_max: 4, k_schedule_steps: 3, embed_dim: 16, hyper_dim: 32}"],
    "smoe_dropout": ["model.moe.router_options={k_min: 1, k_max: 4, k_schedule_steps: 3, init_std: 0.5}"],
}


def model_config(router: str, *more: str):
    return load_config(os.path.join(ROOT, "configs", "test.yaml"), [
        f"model.moe.router={router}", f"model.moe.num_experts={E}", "model.moe.top_k=3",
        *ROUTER_ARGS.get(router, []), *more])


def spans_of(expert_ids: torch.Tensor, groups: int = G) -> torch.Tensor:
    """Distinct groups per token (plain Python)."""
    per = E // groups
    return torch.tensor([len({e // per for e in row}) for row in expert_ids.tolist()])


@pytest.mark.parametrize("router", SUPPORTED)
def test_no_token_spans_more_than_m_groups(router):
    from moe_dist.model import build_model
    from moe_dist.moe.layer import moe_layers

    tokens = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    steps = [0, 1, 2, 3] if router in ("hyper", "smoe_dropout") else [0]  # k = 1, 2, 3, 4 over the schedule
    spread = 0
    for bias in (False, True):
        cfg = model_config(router, f"model.moe.expert_bias={str(bias).lower()}")
        limited = model_config(router, f"model.moe.expert_bias={str(bias).lower()}", f"model.moe.router_groups={G}",
                               f"model.moe.max_groups_per_token={M}")
        free, model = build_model(cfg.model, 512), build_model(limited.model, 512)
        for m in (free, model):
            for i, layer in enumerate(moe_layers(m)):
                if layer.expert_bias is not None:  # a bias large enough to change choices
                    layer.expert_bias.copy_(torch.linspace(-0.3, 0.3, E).roll(i))
        for step in steps:
            for m in (free, model):
                for layer in moe_layers(m):
                    layer.context.step = step
                with torch.no_grad():
                    m(tokens)
            for layer, free_layer in zip(moe_layers(model), moe_layers(free)):
                spans = spans_of(layer.last_routing.expert_ids)
                assert int(spans.max()) <= M, (router, bias, step, spans.max())
                stats = layer.stats.as_dict()
                assert stats["groups_per_token_max"] == int(spans.max())
                assert stats["groups_per_token_mean"] == pytest.approx(float(spans.double().mean()))
                assert "groups_per_token_max" not in free_layer.stats.as_dict()
                spread = max(spread, int(spans_of(free_layer.last_routing.expert_ids).max()))
    assert spread > M  # without the limit some token reaches more groups (the test can fail)


def test_ac_routes_with_the_limit_on_its_clustered_layers():
    """AC's clustered scores (layers from start_layer on, with the previous layer's top-1) are limited too."""
    from moe_dist.model import build_model
    from moe_dist.moe.layer import moe_layers

    cfg = model_config("ac", "model.moe.top_k=2", f"model.moe.router_groups={G}", "model.moe.max_groups_per_token=1")
    model = build_model(cfg.model, 512)
    with torch.no_grad():
        model(torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(1)))
    layers = moe_layers(model)
    assert any(float(l.last_routing.extras["ac_active"]) == 1 for l in layers)
    assert all(int(spans_of(l.last_routing.expert_ids).max()) == 1 for l in layers)


def test_step_metrics_report_groups_per_token():
    from moe_dist.model import build_model
    from moe_dist.moe.layer import moe_layers
    from moe_dist.train.observe.moe_stats import MoEStepStats

    model = build_model(model_config("topk", f"model.moe.router_groups={G}", f"model.moe.max_groups_per_token={M}").model, 512)
    acc = MoEStepStats(model)
    spans = {}
    for micro in range(2):  # two micro-batches: the step's figures cover both
        model(torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(micro)))
        acc.add()
        for layer in moe_layers(model):
            spans.setdefault(layer.context.layer_idx, []).append(spans_of(layer.last_routing.expert_ids))
    summary = acc.summary()
    for idx, parts in spans.items():
        every = torch.cat(parts)
        assert summary[str(idx)]["groups_per_token_max"] == int(every.max()) <= M
        assert summary[str(idx)]["groups_per_token_mean"] == pytest.approx(float(every.double().mean()))


def test_the_limit_adds_no_host_reads():
    """The layer's one read in forward, none in backward, with the group limit and its spans."""
    from helpers.host_sync import count_host_syncs

    torch.manual_seed(0)
    layer = MoELayer(16, MoEArgs(d_ff=8, num_experts=E, top_k=3, router_groups=G, max_groups_per_token=M,
                                 expert_bias=True, expert_kernel="loop"))
    x = torch.randn(24, 16, requires_grad=True)
    layer(x).sum().backward()  # warm-up
    with count_host_syncs() as fwd:
        out = layer(x)
    with count_host_syncs() as rest:
        (out.sum() + layer.aux_loss).backward()
        layer.after_optimizer_step()
    assert len(fwd) == 1, fwd.describe()
    assert len(rest) == 0, rest.describe()


# ---- 1 process vs 2 and 4 ranks ----------------------------------------------------------------
GROUPED = dict(router_groups=G, max_groups_per_token=M, top_k=3)
INVARIANCE_CASES = {
    # k 1 -> 4 over the schedule, then inference at k_max
    "hyper-bias": (dict(GROUPED, router="hyper", expert_bias=True, router_options=dict(
        embed_dim=16, hyper_dim=32, k_min=1, k_max=4, k_schedule_steps=4)),
        [dict(step=0), dict(step=2), dict(step=4), dict(train=False)]),
    "noisy-topk": (dict(GROUPED, router="noisy_topk", router_options=dict(init_std=0.5)), [dict(step=0), dict(step=1)]),
    "xmoe-m1": (dict(GROUPED, router="xmoe", max_groups_per_token=1, top_k=2), [dict(step=0)]),
    "ac": (dict(GROUPED, router="ac"), [dict(labels=True, layer_idx=2)]),
}


def _rank_main(rank, world):
    return run_layouts(build_jobs(), INVARIANCE_CASES)


def test_grouped_routing_does_not_depend_on_the_layout():
    results = run_ranks(_rank_main, SPAWN, args=(), timeout=120)
    for name, (cfg, calls) in INVARIANCE_CASES.items():
        ref = reference_calls(cfg, calls)
        for _, label, per_rank in per_job(results, lambda r, e, u: (name, r, e, u)):
            check_calls(ref, per_rank, f"{name} {label}")
    assert [c["k"] for c in reference_calls(*INVARIANCE_CASES["hyper-bias"])] == [1, 3, 4, 4]


# ---- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("router,why", [
    ("sinkhorn", "transport plan balanced over the whole batch"),
    ("ssr", "transport plan balanced over the whole batch"),
    ("symphony", "chooses through its expert graph"),
])
def test_routers_that_do_not_choose_per_token_are_refused_by_name(router, why):
    with pytest.raises(ConfigError) as err:
        MoEArgs(router=router, num_experts=E, router_groups=G, max_groups_per_token=M).validated()
    msg = str(err.value)
    assert f"model.moe.max_groups_per_token is not allowed with router {router!r}" in msg and why in msg
    assert "\n" not in msg
    assert public(ast.literal_eval(msg.split("allowed routers: ")[1])) == SUPPORTED


def public(names) -> list:
    """The project's routers among ``names`` (a test module may have registered a ``_test_...`` one)."""
    return sorted(n for n in names if not n.startswith("_"))


def test_supported_and_refused_routers_cover_the_registry():
    assert public(n for n, c in ROUTERS.items() if c.supports_group_limit) == SUPPORTED
    assert public(n for n, c in ROUTERS.items() if not c.supports_group_limit) == REFUSED
    assert all(ROUTERS[n].group_limit_refusal for n in REFUSED)


@pytest.mark.parametrize("kwargs,match", [
    (dict(router_groups=G), "model.moe.router_groups needs model.moe.max_groups_per_token"),
    (dict(max_groups_per_token=M), "model.moe.max_groups_per_token needs model.moe.router_groups"),
    (dict(router_groups=3, max_groups_per_token=1), "model.moe.router_groups=3 must divide model.moe.num_experts=8"),
    (dict(router_groups=G, max_groups_per_token=5), "model.moe.max_groups_per_token=5 is not allowed; allowed: 1..4"),
    (dict(router_groups=G, max_groups_per_token=0), "model.moe.max_groups_per_token: 0 is too small; allowed: >= 1"),
    (dict(router_groups=0, max_groups_per_token=1), "model.moe.router_groups: 0 is too small; allowed: >= 1"),
    (dict(router_groups=G, max_groups_per_token=1, top_k=3),
     "model.moe.max_groups_per_token=1: 1 group\\(s\\) of 2 experts hold fewer than the router's k=3"),
    (dict(router="hyper", router_groups=G, max_groups_per_token=2, router_options=dict(k_max=5, k_schedule_steps=9)),
     "hold fewer than the router's k=5 .* allowed: >= 3"),
    (dict(router="topk", router_groups=G, max_groups_per_token=1, router_options=dict(eval_k=4)),
     "hold fewer than the router's k=4"),
])
def test_bad_combinations_are_refused_by_name(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        MoEArgs(**{"num_experts": E, "top_k": 2, **kwargs}).validated()


def test_a_refused_config_is_one_line_and_exit_code_2():
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "moe_dist.cli", "train", "--config", "configs/test.yaml",
                           "model.moe.router=symphony", "model.moe.router_groups=2", "model.moe.max_groups_per_token=1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "model.moe.max_groups_per_token is not allowed with router 'symphony'" in lines[0]


# ---- nodes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("groups,node_of,warns", [
    (4, (0, 0, 1, 1), False),  # 2 groups per node
    (2, (0, 0, 1, 1), False),  # one group = one node
    (2, (0, 0, 0, 0), False),  # one node: nothing crosses nodes
    (2, (0, 0, 1, 1, 2, 2, 3, 3), True),  # a group spans two nodes
    (4, (0, 1, 0, 1), True),  # interleaved nodes: group 0 = ep ranks 0 and 1 on two nodes
])
def test_warning_when_groups_do_not_sit_on_nodes(groups, node_of, warns):
    args = MoEArgs(num_experts=E, top_k=2, router_groups=groups, max_groups_per_token=1)
    note = args.node_limit_warning(NodeLayout(node_of))
    assert bool(note) == warns
    if warns:
        assert note.startswith("warning: model.moe.max_groups_per_token=1") and "\n" not in note
    assert MoEArgs(num_experts=E).node_limit_warning(NodeLayout((0, 1))) == ""


# ---- a training run ----------------------------------------------------------------------------
def test_training_logs_the_spans_and_keeps_the_setting(tmp_path):
    from moe_dist.commands.common import run_config_path
    from moe_dist.train.loop.trainer import train

    cfg = load_config(os.path.join(ROOT, "configs", "test.yaml"), [
        f"run.dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache", f"data.corpus={ROOT}/tests/data/python-docs",
        "parallel.ep=1", "run.tensorboard=false", "run.plots=false", "run.progress=false", "train.steps=2",
        "eval.max_sequences=8", "ckpt.save_final=false", f"model.moe.num_experts={E}", "model.moe.top_k=3",
        f"model.moe.router_groups={G}", f"model.moe.max_groups_per_token={M}", "model.moe.expert_bias=true",
        "model.moe.balance_loss=sequence"])
    train(cfg)
    with open(os.path.join(tmp_path, "run", "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "moe" in r]
    assert rows
    for r in rows:
        for layer in r["moe"].values():
            assert 1 <= layer["groups_per_token_mean"] <= layer["groups_per_token_max"] <= M
    saved = load_config(run_config_path(str(tmp_path / "run")), [])  # what `moe-dist eval --run-dir` builds from
    assert (saved.model.moe.router_groups, saved.model.moe.max_groups_per_token) == (G, M)
