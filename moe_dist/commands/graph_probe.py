"""``python -m moe_dist.commands.graph_probe --run-dir DIR``: what a token-graph router's mixing does
in a trained run (the ``similarity`` or ``attention`` router), per MoE layer; the probe itself is
:mod:`moe_dist.study.graph_probe`."""
from __future__ import annotations

import argparse

from ..study.graph_probe import probe_run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_dist.commands.graph_probe", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True, metavar="DIR", help="a run of the similarity or attention router")
    parser.add_argument("--checkpoint", metavar="PATH", help="default: the latest complete one in DIR/checkpoints")
    parser.add_argument("--sequences", type=int, default=64, help="validation sequences to probe")
    parser.add_argument("--json", metavar="FILE", help="also write the per-layer results to FILE")
    args = parser.parse_args(argv)

    from ..config import load_config
    from ..distributed.bootstrap import shutdown
    from ..errors import MissingInputError
    from ..train.checkpoint import latest_checkpoint
    from ..train.setup.runtime import setup_runtime
    from .common import run_config_path, user_errors

    def go() -> int:
        cfg = load_config(run_config_path(args.run_dir), [f"run.dir={args.run_dir}", f"eval.max_sequences={args.sequences}", "parallel.ep=1"])
        path = args.checkpoint or latest_checkpoint(cfg.run.dir)
        if path is None:
            raise MissingInputError(f"no complete checkpoint under {args.run_dir}/checkpoints")
        rt = setup_runtime(cfg)
        try:
            probe_run(cfg, rt, path, args.run_dir, args.json)
        finally:
            shutdown(rt)
        return 0

    return user_errors("graph_probe", go)


if __name__ == "__main__":
    raise SystemExit(main())
