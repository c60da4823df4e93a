"""Router registry. Each router family lives in its own module and registers by name."""
from .base import Router, check_group_limit, check_top_k, set_inference_k, synchronize_frozen_routers
from .registry import (ROUTERS, build_router, check_router_features, check_router_options, register_router,
                       router_largest_k, router_options)
from . import topk, xmoe  # noqa: F401  (registration)
from . import token_graph  # noqa: F401  (registration: similarity, attention)
from . import symphony  # noqa: F401  (registration: symphony)
from . import ssr  # noqa: F401  (registration: ssr, sinkhorn)
from . import hyper  # noqa: F401  (registration: hyper, smoe_dropout)
from . import ac  # noqa: F401  (registration: ac)

__all__ = ["Router", "ROUTERS", "build_router", "check_group_limit", "check_router_features", "check_router_options",
           "check_top_k", "register_router", "router_largest_k", "router_options", "set_inference_k",
           "synchronize_frozen_routers"]
