"""Router registry. Each router family lives in its own module and registers by name."""
from .base import Router
from .registry import ROUTERS, build_router, register_router, router_options
from . import topk, xmoe  # noqa: F401  (registration)

__all__ = ["Router", "ROUTERS", "build_router", "register_router", "router_options"]
