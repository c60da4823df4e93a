"""What the command line checks before it starts any process (``--nproc N``), so that a mistake is
reported once, in about a second, instead of by every rank after the launch.

Every config key: the schema and cross-field rules (``load_config``), the world-size rules,
``resume`` (auto, none, or a directory holding a checkpoint), the router and layer options (the
model is built on the meta device: no memory), the paths the run reads (``data.corpus``,
``data.tokenizer``, ``ckpt.init_from``, ``deepspeed.config``), the engine (``train.engine:
deepspeed`` needs DeepSpeed importable) and the packages the config asks for (``log.wandb``).
"""
from __future__ import annotations

import os

from ...config import Config
from ...errors import ConfigError, MissingInputError


def check_inputs(cfg: Config) -> None:
    """The files and directories named by the config exist (and the corpus, or each of data.paths, holds data)."""
    from ...data.corpus import corpus_files
    from ...data.datasets import check_paths

    if cfg.data.paths:
        check_paths(cfg.data.paths, "data.paths")
        check_paths(cfg.data.valid_paths, "data.valid_paths")
    else:
        corpus_files(cfg.data.corpus, cfg.data.pattern)
    if cfg.data.tokenizer and not os.path.exists(cfg.data.tokenizer):
        raise MissingInputError(f"data.tokenizer={cfg.data.tokenizer!r} does not exist")
    if cfg.ckpt.init_from and not os.path.isdir(cfg.ckpt.init_from):
        raise MissingInputError(f"ckpt.init_from={cfg.ckpt.init_from!r}: no such directory")
    from .model import check_weights_directory

    check_weights_directory(cfg, cfg.ckpt.init_from)
    if cfg.train.engine == "deepspeed" and cfg.deepspeed.config and not os.path.isfile(cfg.deepspeed.config):
        raise MissingInputError(f"deepspeed.config={cfg.deepspeed.config!r} does not exist")


def check_model(cfg: Config) -> None:
    """Build the model on the meta device: every router and layer option is checked by its owner."""
    from .model import build_meta_model

    build_meta_model(cfg, cfg.model.vocab_size or cfg.data.vocab_size)


def check_engine(cfg: Config) -> None:
    """``train.engine: deepspeed`` needs DeepSpeed importable (here, before any rank starts or a run
    directory is made, instead of in every rank after the launch)."""
    if cfg.train.engine != "deepspeed":
        return
    from ...distributed.bootstrap import device_type
    from ..engines.deepspeed import require_deepspeed

    require_deepspeed(device_type(cfg.run.device))


def check_resume(cfg: Config) -> None:
    from ..checkpoint.resume import resolve_resume

    _, _, error = resolve_resume(cfg.resume, cfg.run.dir)
    if error:
        raise ConfigError(error)


def check_expert_shard(cfg: Config, world_size: int) -> None:
    """``parallel.expert_shard=within`` needs a dimension of the expert weights that the replicas
    (``edp = world / ep``) divide: refused here, once, rather than by every rank in ``fully_shard``
    (``parallel.ep=auto`` depends on the ranks' hosts: its ranks check it themselves)."""
    ep = cfg.parallel.ep
    if cfg.parallel.dense != "fsdp" or world_size == 1 or not isinstance(ep, int) or cfg.train.engine != "native":
        return
    from ...parallel.expert_shard import expert_weight_shapes, shard_dim

    m = cfg.model
    for shape in expert_weight_shapes(m.moe.num_experts // ep, m.d_model, m.moe.d_ff or m.d_ff,
                                      m.moe.activation == "swiglu"):
        shard_dim(shape, world_size // ep, cfg.parallel.expert_shard)


def check_before_launch(cfg: Config, world_size: int, *, training: bool = True) -> None:
    """Raise a :class:`~moe_dist.errors.UserError` for the first problem found. ``training``: also
    what only training needs (``resume``, the engine, ``log.wandb``); evaluation reads a checkpoint
    with none of them."""
    from ..observe.tracking import check_tracking

    cfg.check_world(world_size)
    check_expert_shard(cfg, world_size)
    if training:
        check_tracking(cfg)
        check_resume(cfg)
    check_model(cfg)
    check_inputs(cfg)
    if training:
        check_engine(cfg)
