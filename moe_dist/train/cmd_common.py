"""Pieces shared by the train and eval commands."""
from __future__ import annotations

import os
import sys
from typing import Callable


def is_rank0() -> bool:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))) == "0"


def add_overrides_argument(parser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. train.steps=200 model.moe.top_k=1 (values are YAML)")


def user_errors(command: str, fn: Callable[[], int]) -> int:
    """Run ``fn``; bad configuration or input prints one line (rank 0) and exits with 2."""
    from ..config import ConfigError

    try:
        return fn()
    except (ConfigError, FileNotFoundError, ValueError) as e:
        if is_rank0():
            print(f"moe-dist {command}: error: {e}", file=sys.stderr, flush=True)
        return 2
