"""``moe-dist train``: train an MoE language model from a YAML config plus overrides."""
from __future__ import annotations

from .common import add_overrides_argument, user_errors

HELP = "train an MoE language model (config: YAML file + KEY=VALUE overrides)"
LAUNCHABLE = True


def add_arguments(parser) -> None:
    parser.add_argument("--config", "-c", metavar="PATH", help="YAML config (default: the schema defaults)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--list-keys", action="store_true", help="list every config key with its allowed values and exit")
    add_overrides_argument(parser)


def _list_keys() -> int:
    from ..config import describe_schema

    for key, allowed, default, help_text in describe_schema():
        print(f"{key:32s} {allowed}\n{'':32s} default: {default!r}. {help_text}")
    return 0


def preflight(args, world_size: int) -> int:
    """Check the config before starting ``world_size`` processes (errors once, not per rank)."""
    if args.list_keys or args.print_config:
        return 0

    def check() -> int:
        from ..config import load_config
        from ..train.setup.preflight import check_before_launch

        check_before_launch(load_config(args.config, args.overrides), world_size)
        return 0

    return user_errors("train", check)


def run(args) -> int:
    if args.list_keys:
        return _list_keys()

    def go() -> int:
        from ..config import dump_config, load_config

        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            print(dump_config(cfg), end="")
            return 0
        from ..train.loop.trainer import train
        from ..train.setup.preflight import check_engine

        check_engine(cfg)  # one rank of a launched job: before the run directory is made
        train(cfg)
        return 0

    return user_errors("train", go)
