"""The engine interface: how the model is spread over the ranks and how it is updated.

The trainer owns the model, the data, the loss and the schedule; an engine owns what
happens to the gradients and the weights. One optimizer step of the trainer is::

    engine.optimizer.param_groups[...]["lr"] = lr  # the schedule's learning rate
    for each micro-batch:
        engine.set_gradient_sync(last micro-batch)
        loss = f(engine.forward(tokens))
        engine.backward(loss)                       # loss = this rank's share of the global loss
    grad_norm = engine.step(loss_finite)            # reduce, clip, update: the global norm before clipping
    engine.zero_grad()                              # (engine.skipped: a non-finite step was not applied)

Checkpoints read and write the weights through the model and the optimizer state through
``engine.optimizer`` (per parameter, full tensors, like ``torch.optim.AdamW.state``); an
engine that keeps either elsewhere fills them inside :meth:`Engine.state_for_save` and takes
them back in :meth:`Engine.state_loaded`.
"""
from __future__ import annotations

import abc
import contextlib
from typing import Callable, Iterator

import torch
import torch.nn as nn


class Engine(abc.ABC):
    """One way of training the model: built from the config and the runtime, then :meth:`prepare`d
    with the model the trainer built (on the meta device: nothing allocated yet)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer  # per parameter: the trainer sets its lr, checkpoints read and write its state
    skipped: bool = False  # the last step() was not applied (non-finite loss or gradient norm)

    def __init__(self, cfg, rt, log: Callable[[str], None] = print):
        self.cfg, self.rt, self.log = cfg, rt, log

    @abc.abstractmethod
    def prepare(self, model: nn.Module, fill: Callable[[nn.Module], None]) -> None:
        """Apply parallelism to ``model`` (in place) and build the optimizer. A model built on the
        meta device is split first, then this rank's part is allocated and ``fill(model)`` sets
        its weights (:func:`moe_dist.train.setup.model.weights_filler`)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    @abc.abstractmethod
    def set_gradient_sync(self, enabled: bool) -> None:
        """Reduce the gradients in the coming backward (the last micro-batch of a step) or not."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of ``loss``, this rank's share of the step's global loss (gradients are summed over ranks)."""

    @abc.abstractmethod
    def step(self, loss_finite: bool = True) -> float:
        """After the last backward of a step: finish reducing the gradients, clip them to
        ``train.grad_clip``, step the optimizer, unless the step's global loss (``loss_finite``)
        or gradient norm is not finite: then nothing is applied and :attr:`skipped` is set.
        Returns the global gradient norm before clipping (every dense weight and every expert
        counted once)."""

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Drop the gradients after :meth:`step`."""

    @abc.abstractmethod
    def dense_layout(self) -> str:
        """How the dense (non-expert) weights are spread, for logs and ``run.json``."""

    @contextlib.contextmanager
    def state_for_save(self) -> Iterator[None]:
        """Collective. Within the block, the model and ``optimizer.state`` hold the full state to save."""
        yield

    def state_loaded(self) -> None:
        """Collective. After a checkpoint was loaded into the model and ``optimizer.state``."""

    def close(self) -> None:
        """Release what :meth:`prepare` started."""
