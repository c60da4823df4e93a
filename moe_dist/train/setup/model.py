"""How a command gets its model without any rank holding all of it.

The model is built on the meta device (no memory), the engine decides what each rank holds
(expert-parallel slices, FSDP2 shards) and allocates only that, then fills it with the
function :func:`weights_filler` returns: the rows this rank owns from a safetensors
directory (``ckpt.init_from``: an upcycled or converted checkpoint), or the seeded,
layout-independent initialisation of :mod:`moe_dist.model.init`.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch.nn as nn

from ...config import Config
from ...model import build_model
from ...model.init import init_weights


def build_meta_model(cfg: Config, vocab_size: int) -> nn.Module:
    return build_model(cfg.model, vocab_size, seed=cfg.train.seed, device="meta")


def is_weights_directory(path: str) -> bool:
    """A safetensors model directory (``moe-dist upcycle`` / ``convert`` output), not a DCP checkpoint."""
    from ...weights import has_model_weights

    return os.path.isdir(path) and has_model_weights(path) and not os.path.exists(os.path.join(path, "meta.json"))


def check_weights_directory(cfg: Config, path: Optional[str]) -> None:
    """Before the data are prepared: a model directory the run starts from or evaluates
    (``ckpt.init_from``, ``eval --checkpoint``) is a complete output, and weights converted
    without their tokenizer are used only with ``data.tokenizer`` naming one."""
    if not path or not is_weights_directory(path):
        return
    from ...weights import SafetensorsCheckpoint, check_tokenizer_named

    SafetensorsCheckpoint(path)  # headers only; refuses an incomplete output
    check_tokenizer_named(path, cfg.data.tokenizer)


def weights_filler(cfg: Config, weights: Optional[str]) -> Callable[[nn.Module], None]:
    """``fill(model)``: load the safetensors directory ``weights`` rank-locally (the trainer passes
    ``ckpt.init_from``), or, with ``None``, initialise from ``train.seed`` (also before a training
    checkpoint is loaded over it: frozen routers must agree across ranks when they are checked)."""

    def fill(model: nn.Module) -> None:
        if weights:
            from ...weights import load_model_weights

            load_model_weights(model, weights)
        else:
            init_weights(model, cfg.train.seed)

    return fill
