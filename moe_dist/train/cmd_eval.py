"""``moe-dist eval``: validation perplexity of a run's checkpoint next to a unigram baseline."""
from __future__ import annotations

import os

from .cmd_common import add_overrides_argument, user_errors

HELP = "evaluate a checkpoint of a run on the validation split (perplexity vs a unigram baseline)"
LAUNCHABLE = True


def add_arguments(parser) -> None:
    parser.add_argument("--run-dir", required=True, metavar="DIR", help="a run directory written by `moe-dist train`")
    parser.add_argument("--checkpoint", metavar="PATH", help="checkpoint directory (default: the latest in DIR/checkpoints)")
    add_overrides_argument(parser)


def _config(args):
    from ..config import load_config

    config_path = os.path.join(args.run_dir, "config.yaml")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"--run-dir {args.run_dir!r} has no config.yaml (is it a moe-dist run directory?)")
    return load_config(config_path, [f"run.dir={args.run_dir}", *args.overrides])


def preflight(args, world_size: int) -> int:
    """Check the run directory and config before starting ``world_size`` processes."""
    return user_errors("eval", lambda: _config(args).check_world(world_size) or 0)


def run(args) -> int:
    def go() -> int:
        from .trainer import evaluate_run

        evaluate_run(_config(args), args.checkpoint)
        return 0

    return user_errors("eval", go)
