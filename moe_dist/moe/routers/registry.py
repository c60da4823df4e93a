"""Routers by name, with option checking that names the bad key and the allowed ones."""
from __future__ import annotations

import inspect
from typing import Callable

from .base import Router
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


def build_router(name: str, d_model: int, num_experts: int, top_k: int, **options) -> Router:
    if name not in ROUTERS:
        raise ConfigError(f"model.moe.router={name!r} is not a known router; allowed: {sorted(ROUTERS)}")
    allowed = router_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(f"model.moe.router_options: unknown key(s) {unknown} for router {name!r}; allowed: {allowed}")
    kwargs = {**ROUTER_DEFAULTS[name], **options}
    return ROUTERS[name](d_model, num_experts, top_k, **kwargs)
