"""Granular upcycling's config step (arXiv 2410.07524): ``model.moe.granularity=G`` with
``num_experts=N`` and ``top_k=k`` given per copy of the dense FFN becomes a model of ``N*G``
experts of hidden size ``d_ff / G`` with ``top_k = k*G``. One rule, used by ``moe-dist upcycle``
and by ``moe-dist plan`` of a dense checkpoint; the expanded mapping holds ``granularity: 1``
(a model config always gives the real expert count, top-k and expert hidden size)."""
from __future__ import annotations

from .schema import ConfigError, MoEConfig


def expand_granularity(moe: dict, dense_d_ff: int) -> int:
    """Expand ``moe`` (the raw ``model.moe`` mapping, changed in place) and return G."""
    defaults = MoEConfig()
    g = moe.get("granularity", 1)
    if isinstance(g, bool) or not isinstance(g, int) or g < 1:
        raise ConfigError(f"model.moe.granularity: {g!r}; allowed: an integer >= 1")
    if g == 1:
        return 1
    if dense_d_ff % g:
        raise ConfigError(f"model.moe.granularity: {g} must divide the dense FFN's intermediate size {dense_d_ff}")
    if moe.get("d_ff") not in (None, dense_d_ff // g):
        raise ConfigError(f"model.moe.d_ff: {moe['d_ff']}; with model.moe.granularity={g} the experts are slices of "
                          f"the dense FFN (allowed: null or {dense_d_ff // g})")
    router = moe.get("router", defaults.router)
    from ..moe.routers import ROUTERS  # registry: routers register on import

    if router in ROUTERS and not ROUTERS[router].per_expert_tensors:
        allowed = ", ".join(sorted(name for name, cls in ROUTERS.items() if cls.per_expert_tensors))
        raise ConfigError(f"model.moe.granularity: {g} is not allowed with router {router!r} (virtual-group "
                          f"initialisation duplicates per-expert router rows); allowed: routers whose per-expert "
                          f"scores come from per-expert rows: {allowed}")
    for key in ("num_experts", "top_k"):
        value = moe.get(key, getattr(defaults, key))
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"model.moe.{key}: {value!r}; allowed: an integer >= 1")
        moe[key] = value * g
    moe["d_ff"], moe["granularity"] = dense_d_ff // g, 1
    return g
