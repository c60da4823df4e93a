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
    """Run ``fn``; a :class:`~moe_dist.errors.UserError` (bad configuration, input data, checkpoint or
    argument) prints one line (rank 0) and returns 2. Any other exception propagates with its
    traceback: it is a bug or a failure of the environment, not something the user typed."""
    from ..errors import UserError

    try:
        return fn()
    except UserError as e:
        if is_rank0():
            print(f"moe-dist {command}: error: {e}", file=sys.stderr, flush=True)
        return 2
