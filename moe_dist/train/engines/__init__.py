"""Training engines behind one interface (:class:`~.base.Engine`): ``native`` (FSDP2 or
replicated dense weights, expert parallelism) and ``deepspeed`` (DeepSpeed ZeRO-1/2).
:func:`create_engine` is the one place that picks one from ``train.engine``."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from .base import Engine

__all__ = ["Engine", "create_engine", "engine_scope"]


def create_engine(cfg, rt, log: Callable[[str], None] = print) -> Engine:
    """The engine ``train.engine`` names (not yet prepared). DeepSpeed's is imported only when chosen."""
    if cfg.train.engine == "deepspeed":
        from .deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(cfg, rt, log)
    from .native import NativeEngine

    return NativeEngine(cfg, rt, log)


@contextlib.contextmanager
def engine_scope(cfg, rt) -> Iterator[None]:
    """What the ``train.engine`` keeps for a whole job, across the trainers a rollback starts one
    after the other: DeepSpeed's one-process group (its group caches outlive an engine)."""
    if cfg.train.engine != "deepspeed":
        yield
        return
    from .deepspeed import single_process_group

    with single_process_group(rt):
        yield
