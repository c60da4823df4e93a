"""Pieces shared by the commands."""
from __future__ import annotations

import os
import sys
from typing import Callable


def is_rank0() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == "0"


def is_local_rank0() -> bool:
    """The first process on this host (``LOCAL_RANK`` of torchrun, Slurm's or MPI's local id)."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        if os.environ.get(var, "").strip():
            return os.environ[var].strip() == "0"
    return True


def add_overrides_argument(parser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. train.steps=200 model.moe.top_k=1 (values are YAML)")


def add_weights_writer_arguments(parser, preset_example: str) -> None:
    """``--config``, ``--dtype`` and ``--max-shard-gib``: the options of the commands that write a
    Hugging Face checkpoint as our safetensors (``upcycle``, ``import``); see :func:`max_shard_bytes`."""
    parser.add_argument("--config", "-c", metavar="PATH",
                        help=f"a preset YAML (e.g. {preset_example}) applied before the overrides")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                        help="dtype of the written weights (auto = the checkpoint's)")
    parser.add_argument("--max-shard-gib", type=float, default=4.0, metavar="G", help="split the weights into files of about G GiB")


def max_shard_bytes(args) -> int:
    """``--max-shard-gib`` in bytes (a user error unless > 0)."""
    from ..errors import UsageError

    if args.max_shard_gib <= 0:
        raise UsageError(f"--max-shard-gib {args.max_shard_gib}; allowed: > 0")
    return int(args.max_shard_gib * (1 << 30))


def run_config_path(run_dir: str) -> str:
    """``run_dir/config.yaml`` (the config ``moe-dist train`` wrote there), or a MissingInputError."""
    from ..errors import MissingInputError

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.exists(path):
        raise MissingInputError(f"--run-dir {run_dir!r} has no config.yaml (is it a moe-dist run directory?)")
    return path


def user_errors(command: str, fn: Callable[[], int]) -> int:
    """Run ``fn``; a :class:`~moe_dist.errors.UserError` (bad configuration, input data, checkpoint or
    argument) prints one line (rank 0; a :class:`~moe_dist.errors.HostError`: the first process of every
    host) and returns 2. Any other exception propagates with its
    traceback: it is a bug or a failure of the environment, not something the user typed."""
    from ..errors import HostError, UserError

    try:
        return fn()
    except UserError as e:
        if is_rank0() or (isinstance(e, HostError) and is_local_rank0()):
            print(f"moe-dist {command}: error: {e}", file=sys.stderr, flush=True)
        return 2
