"""``train.engine: native``: torch.distributed only.

Experts are spread by expert parallelism and sharded over (or, with replicated dense weights,
summed over) their replicas; dense weights are sharded with FSDP2 or replicated
(``parallel.dense``), see :mod:`moe_dist.parallel.parallelize`.
The optimizer is :func:`moe_dist.train.loop.optim.build_optimizer`'s AdamW.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn

from ..loop.optim import build_optimizer
from ...parallel.parallelize import Parallelized, parallelize
from .base import Engine


class NativeEngine(Engine):
    par: Parallelized

    def prepare(self, model: nn.Module, fill: Callable[[nn.Module], None]) -> None:
        self.model = model
        self.par = parallelize(model, self.rt, self.cfg.parallel, fill=fill, dtype=self.cfg.train.dtype)
        self.optimizer = build_optimizer(model, self.cfg.train)

    def set_gradient_sync(self, enabled: bool) -> None:
        self.par.set_gradient_sync(enabled)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, loss_finite: bool = True) -> float:
        self.par.finish_gradients()
        grad_norm = self.par.clip_gradients(self.cfg.train.grad_clip)
        self.skipped = not (loss_finite and math.isfinite(grad_norm))  # the same on every rank: global figures
        if not self.skipped:
            self.optimizer.step()
        return grad_norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def dense_layout(self) -> str:
        return self.cfg.parallel.dense if self.rt.distributed else "local"
