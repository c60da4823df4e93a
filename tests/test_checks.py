"""One rule in one place: a refused choice, the top_k rule, the router options and the layer
features each read the same wherever they are caught (the config before launch, the MoE layer,
a router built on its own, a helper deep inside)."""
import os

import pytest
import torch

from moe_dist.checks import check_choice, coerce_value
from moe_dist.config import load_config
from moe_dist.distributed.bootstrap import pick_backend, pick_device
from moe_dist.errors import ConfigError
from moe_dist.model.layers import Attention
from moe_dist.moe import build_router, MoEArgs, MoELayer
from moe_dist.moe.experts import GroupedExperts
from moe_dist.moe.routers.symphony import normalize_counts
from moe_dist.moe.routing.types import SCOPES, RoutingContext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEST_CONFIG = os.path.join(ROOT, "configs", "test.yaml")


def _message(fn) -> str:
    with pytest.raises(ConfigError) as info:
        fn()
    return str(info.value)


def _config(*overrides: str):
    return load_config(TEST_CONFIG, list(overrides))


def _choice(key: str, value, allowed) -> str:
    return f"{key}={value!r} is not allowed; allowed: {list(allowed)}"


@pytest.mark.parametrize("key, value, allowed, refuse", [
    # the MoE layer
    ("model.moe.drop_policy", "random", ["position", "probs"], lambda: MoELayer(16, MoEArgs(d_ff=32, num_experts=8,
                                                                                            top_k=2,
                                                                                            drop_policy="random"))),
    ("model.moe.balance_loss", "token", ["batch", "sequence"], lambda: MoELayer(16, MoEArgs(d_ff=32, num_experts=8,
                                                                                            top_k=2,
                                                                                            balance_loss="token"))),
    ("model.moe.activation", "relu", ["swiglu", "gelu"], lambda: GroupedExperts(4, 8, 16, activation="relu")),
    # the config, a Literal key: the same wording as the layer's
    ("model.moe.drop_policy", "random", ["position", "probs"], lambda: _config("model.moe.drop_policy=random")),
    ("model.moe.router", "nope", None, lambda: _config("model.moe.router=nope")),
    ("model.moe.router", "nope", None, lambda: MoELayer(16, MoEArgs(d_ff=32, num_experts=8, top_k=2, router="nope"))),
    # router options (the former token_stats, symphony and token_graph forms)
    ("model.moe.router_options.scope", "all", SCOPES, lambda: build_router("ssr", 16, 8, 2, scope="all")),
    ("model.moe.router_options.scope", "all", SCOPES, lambda: build_router("ac", 16, 8, 2, scope="all")),
    ("model.moe.router_options.scope", "all", SCOPES, lambda: build_router("symphony", 16, 8, 2, scope="all")),
    ("model.moe.router_options.scope", "all", SCOPES, lambda: RoutingContext().group_for("all")),
    ("model.moe.router_options.dispersion", "std", ["mad", "var"], lambda: build_router("ac", 16, 8, 2, dispersion="std")),
    ("model.moe.router_options.init", "eye", ["zero", "identity"], lambda: build_router("symphony", 16, 8, 2, init="eye")),
    ("model.moe.router_options.normalization", "l2", ["row", "column", "symmetric"],
     lambda: normalize_counts(torch.zeros(4, 4), "l2")),
    ("model.moe.router_options.similarity", "l1", ["dot", "cosine"],
     lambda: build_router("similarity", 16, 8, 2, similarity="l1")),
    ("model.moe.router_options.aux_probs", "x", ["mixed", "base"], lambda: build_router("attention", 16, 8, 2, aux_probs="x")),
    ("model.moe.router_options.base", "symphony", None, lambda: build_router("similarity", 16, 8, 2, base="symphony")),
    # the model and the launcher
    ("model.qk_norm", "head", ["none", "projection"], lambda: Attention(16, 2, 2, 0.02, 0.02, qk_norm="head")),
    ("run.device", "tpu", ["auto", "cpu", "cuda"], lambda: pick_device("tpu", 0)),
    ("parallel.backend", "mpi", ["auto", "gloo", "nccl"], lambda: pick_backend("mpi", torch.device("cpu"))),
])
def test_a_refused_choice_reads_the_same_everywhere(key, value, allowed, refuse):
    message = _message(refuse)
    if allowed is None:  # a list that grows with the registry: only its form
        assert message.startswith(f"{key}={value!r} is not allowed; allowed: ['"), message
    else:
        assert message == _choice(key, value, allowed)


def test_a_choice_is_not_a_bool_that_equals_it():
    check_choice("deepspeed.zero_stage", 1, (1, 2))
    assert _message(lambda: check_choice("deepspeed.zero_stage", True, (1, 2))) == _choice("deepspeed.zero_stage", True, (1, 2))


def test_top_k_against_num_experts_has_one_message():
    expected = "model.moe.top_k=9 must be between 1 and model.moe.num_experts=8"
    assert _message(lambda: _config("model.moe.num_experts=8", "model.moe.top_k=9")) == expected
    assert _message(lambda: MoELayer(16, MoEArgs(d_ff=32, num_experts=8, top_k=9))) == expected
    assert _message(lambda: build_router("topk", 16, 8, 9)) == expected
    assert _message(lambda: build_router("hyper", 16, 8, 9)) == expected


def test_router_options_are_checked_by_one_rule():
    unknown = "model.moe.router_options: unknown key(s) ['bogus'] for router 'topk'; allowed: "
    assert _message(lambda: _config("model.moe.router_options={bogus: 1}")).startswith(unknown)
    assert _message(lambda: MoELayer(16, MoEArgs(d_ff=32, num_experts=8, top_k=2,
                                                 router_options={"bogus": 1}))).startswith(unknown)
    # a wrong type names the key and what its declared type allows, before any arithmetic on it
    wrong_type = "model.moe.router_options.p: got 'abc' (str); allowed: a number"
    assert _message(lambda: _config("model.moe.router=ssr", "model.moe.router_options.p=abc")) == wrong_type
    assert _message(lambda: build_router("ssr", 16, 8, 2, p="abc")) == wrong_type
    assert _message(lambda: build_router("xmoe", 16, 8, 2, dim="4")) == \
        "model.moe.router_options.dim: got '4' (str); allowed: an integer"
    assert _message(lambda: _config("model.moe.router=similarity", "model.moe.router_options.base_options=3")) == \
        "model.moe.router_options.base_options: got 3 (int); allowed: a mapping or null"
    # what YAML reads as a string but is a number is that number
    assert build_router("ssr", 16, 8, 2, tol="1e-3").tol == 1e-3


@pytest.mark.parametrize("override, layer_kwargs, expected", [
    ("model.moe.expert_bias=true", dict(expert_bias=True), "model.moe.expert_bias=true is not allowed with router 'ssr'"),
    ("model.moe.router_dtype=fp64", dict(router_dtype="fp64"), "model.moe.router_dtype=fp64 is not allowed with router 'ssr'"),
])
def test_router_features_have_one_message(override, layer_kwargs, expected):
    from_config = _message(lambda: _config("model.moe.router=ssr", override))
    from_layer = _message(lambda: MoELayer(16, MoEArgs(d_ff=32, num_experts=8, top_k=2, router="ssr", **layer_kwargs)))
    assert from_config == from_layer and from_config.startswith(expected)


def test_a_value_of_a_declared_type():
    from typing import Optional

    assert coerce_value(3, float, "k") == 3.0 and isinstance(coerce_value(3, float, "k"), float)
    assert coerce_value(None, Optional[int], "k") is None and coerce_value(2, int | None, "k") == 2
    assert _message(lambda: coerce_value(True, int, "k")) == "k: got True (bool); allowed: an integer"
    assert _message(lambda: coerce_value("x", bool | None, "k")) == "k: got 'x' (str); allowed: true or false or null"


@pytest.mark.parametrize("overrides, layer_kwargs, expected", [
    (["model.moe.capacity_factor=0"], dict(capacity_factor=0), "model.moe.capacity_factor: 0.0 is not allowed; allowed: > 0"),
    (["model.moe.eval_capacity_factor=-1"], dict(eval_capacity_factor=-1),
     "model.moe.eval_capacity_factor: -1.0 is not allowed; allowed: > 0"),
    (["model.moe.min_capacity=-2"], dict(min_capacity=-2), "model.moe.min_capacity: -2 is too small; allowed: >= 0"),
    (["model.moe.expert_bias_rate=-0.5"], dict(expert_bias_rate=-0.5),
     "model.moe.expert_bias_rate: -0.5 is too small; allowed: >= 0"),
    (["model.moe.capacity_factor=abc"], dict(capacity_factor="abc"),
     "model.moe.capacity_factor: got 'abc' (str); allowed: a number or null"),
    (["model.moe.shared_gate=true"], dict(shared_gate=True),
     "model.moe.shared_gate: true needs a shared expert; set model.moe.shared_d_ff > 0"),
])
def test_layer_bounds_read_as_the_config_reads_them(overrides, layer_kwargs, expected):
    assert _message(lambda: _config(*overrides)) == expected
    assert _message(lambda: MoELayer(16, MoEArgs(d_ff=32, num_experts=8, top_k=2, **layer_kwargs))) == expected
