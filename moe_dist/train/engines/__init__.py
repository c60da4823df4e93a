"""Training engines behind one interface (:class:`~.base.Engine`): ``native`` (FSDP2 or
replicated dense weights, expert parallelism) and ``deepspeed`` (DeepSpeed ZeRO-1/2).
:func:`create_engine` is the one place that picks one from ``train.engine``."""
from __future__ import annotations

from typing import Callable

from .base import Engine

__all__ = ["Engine", "create_engine"]


def create_engine(cfg, rt, log: Callable[[str], None] = print) -> Engine:
    """The engine ``train.engine`` names (not yet prepared). DeepSpeed's is imported only when chosen."""
    if cfg.train.engine == "deepspeed":
        from .deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(cfg, rt, log)
    from .native import NativeEngine

    return NativeEngine(cfg, rt, log)
