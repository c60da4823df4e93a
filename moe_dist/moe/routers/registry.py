"""Routers by name, and the one check of a router choice: the name, its options (known keys,
values of the types its ``__init__`` declares) and the layer features it supports. The config
(before launch) and the builders (:func:`build_router`, the MoE layer) call the same checks, so a
mistake reads the same wherever it is caught."""
from __future__ import annotations

import inspect
import typing
from typing import Any, Callable

from .base import Router
from ...checks import check_choice, coerce_value
from ...errors import ConfigError

ROUTERS: dict[str, Callable[..., Router]] = {}
ROUTER_DEFAULTS: dict[str, dict] = {}


def register_router(name: str, **preset):
    """Class decorator (or call with a class) registering a router under ``name``.

    ``preset`` fixes options for this name (e.g. ``noisy_topk`` = ``topk`` with noise).
    """

    def deco(cls):
        if name in ROUTERS:
            raise ValueError(f"router {name!r} registered twice")
        ROUTERS[name] = cls
        ROUTER_DEFAULTS[name] = dict(preset)
        return cls

    return deco


def router_options(name: str) -> list[str]:
    """Option names a router accepts besides (d_model, num_experts, top_k)."""
    fixed = {"self", "d_model", "num_experts", "top_k"}
    return [p for p in inspect.signature(ROUTERS[name].__init__).parameters if p not in fixed]


def _option_types(name: str) -> dict[str, Any]:
    """The declared type of each annotated option of a router (``p: float`` -> ``float``)."""
    hints = typing.get_type_hints(ROUTERS[name].__init__)
    return {p: hints[p] for p in router_options(name) if p in hints}


def check_router_options(name: str, options: dict) -> dict:
    """``model.moe.router`` is a registered router and ``model.moe.router_options`` are options it
    takes, each of its declared type. Returns the options in canonical form (an integer given for
    a number is that number, YAML's ``1e-3`` string too); raises :class:`ConfigError` naming the key."""
    check_choice("model.moe.router", name, sorted(ROUTERS))
    allowed = router_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(f"model.moe.router_options: unknown key(s) {unknown} for router {name!r}; allowed: {allowed}")
    types = _option_types(name)
    return {key: coerce_value(value, types[key], f"model.moe.router_options.{key}") if key in types else value
            for key, value in options.items()}


def _routers_with(flag: str) -> list[str]:
    return sorted(n for n, c in ROUTERS.items() if getattr(c, flag, False))


def router_largest_k(name: str, top_k: int, options: dict) -> int:
    """The most experts per token router ``name`` built with ``top_k`` and (checked) ``options``
    routes to, in training or at inference (:meth:`Router.largest_k`)."""
    return ROUTERS[name].largest_k(top_k, {**ROUTER_DEFAULTS[name], **options})


def check_router_features(name: str, expert_bias: bool, router_dtype: str, group_limit: bool = False) -> None:
    """``model.moe.expert_bias``, ``model.moe.router_dtype=fp64`` and ``model.moe.max_groups_per_token``
    only with a router that supports them."""
    cls = ROUTERS[name]
    if group_limit and not cls.supports_group_limit:
        why = cls.group_limit_refusal or "it does not choose by a top-k of per-token scores"
        raise ConfigError(f"model.moe.max_groups_per_token is not allowed with router {name!r} ({why}); allowed "
                          f"routers: {_routers_with('supports_group_limit')}")
    if expert_bias and not cls.supports_expert_bias:
        raise ConfigError(f"model.moe.expert_bias=true is not allowed with router {name!r} (it does not choose by "
                          "top-k of its probabilities: Sinkhorn balances by itself, Symphony chooses through its "
                          f"graph); allowed routers: {_routers_with('supports_expert_bias')}")
    if router_dtype != "fp32" and not cls.supports_fp64:
        raise ConfigError(f"model.moe.router_dtype={router_dtype} is not allowed with router {name!r}; allowed "
                          f"routers: {_routers_with('supports_fp64')} (the others compute in fp32)")


def build_router(name: str, d_model: int, num_experts: int, top_k: int, **options) -> Router:
    options = check_router_options(name, options)
    return ROUTERS[name](d_model, num_experts, top_k, **{**ROUTER_DEFAULTS[name], **options})
