"""What the command line checks before it starts any process (``--nproc N``), so that a mistake is
reported once, in about a second, instead of by every rank after the launch.

Every config key: the schema and cross-field rules (``load_config``), the world-size rules,
``resume`` (auto, none, or a directory holding a checkpoint), the router and layer options (the
model is built on the meta device: no memory), and the paths the run reads (``data.corpus``,
``data.tokenizer``, ``ckpt.init_from``, ``deepspeed.config``), and the packages the config asks for
(``log.wandb``).
"""
from __future__ import annotations

import os

from ..config import Config
from ..errors import ConfigError, MissingInputError


def check_inputs(cfg: Config) -> None:
    """The files and directories named by the config exist (and the corpus holds files)."""
    from ..data.corpus import corpus_files

    corpus_files(cfg.data.corpus, cfg.data.pattern)
    if cfg.data.tokenizer and not os.path.isfile(cfg.data.tokenizer):
        raise MissingInputError(f"data.tokenizer={cfg.data.tokenizer!r} does not exist")
    if cfg.ckpt.init_from and not os.path.isdir(cfg.ckpt.init_from):
        raise MissingInputError(f"ckpt.init_from={cfg.ckpt.init_from!r}: no such directory")
    if cfg.train.engine == "deepspeed" and cfg.deepspeed.config and not os.path.isfile(cfg.deepspeed.config):
        raise MissingInputError(f"deepspeed.config={cfg.deepspeed.config!r} does not exist")


def check_model(cfg: Config) -> None:
    """Build the model on the meta device: every router and layer option is checked by its owner."""
    from .model_setup import build_meta_model

    build_meta_model(cfg, cfg.model.vocab_size or cfg.data.vocab_size)


def check_resume(cfg: Config) -> None:
    from .checkpoint.resume import resolve_resume

    _, _, error = resolve_resume(cfg.resume, cfg.run.dir)
    if error:
        raise ConfigError(error)


def check_before_launch(cfg: Config, world_size: int, *, resume: bool = True) -> None:
    """Raise a :class:`~moe_dist.errors.UserError` for the first problem found."""
    from .tracking import check_tracking

    cfg.check_world(world_size)
    check_tracking(cfg)
    if resume:
        check_resume(cfg)
    check_model(cfg)
    check_inputs(cfg)
