"""The Mixture-of-Experts layer and its parts.

    from moe_dist.moe import MoEArgs, MoELayer, collect_aux_loss, collect_stats

    layer = MoELayer(d_model, MoEArgs(d_ff=1024, num_experts=8, top_k=2))

From the top: the layer (:mod:`.layer`); the dispatcher (:mod:`.dispatch`: it owns every
exchange); the routing stage (:mod:`.routing`) and the routers (:mod:`.routers`); the experts, which
only compute (:mod:`.experts`); the row helpers (:mod:`.rows`). ``tests/test_imports.py`` checks
that imports inside this package point down that order.
"""
from .args import MoEArgs
from .experts import GroupedExperts
from .layer import MoELayer, collect_aux_loss, collect_stats, moe_layers
from .routing.layer_stats import MoEStats
from .routers import ROUTERS, Router, build_router, register_router
from .routing.types import AttentionInputs, RouterInputs, Routing, RoutingContext
from .shared import SharedExpert

__all__ = [
    "MoELayer", "MoEArgs", "GroupedExperts", "SharedExpert", "MoEStats", "Routing", "RoutingContext", "RouterInputs",
    "AttentionInputs", "Router", "ROUTERS",
    "build_router", "register_router", "collect_aux_loss", "collect_stats", "moe_layers",
]
