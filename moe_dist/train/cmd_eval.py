"""``moe-dist eval``: validation perplexity of a run's checkpoint next to a unigram baseline."""
from __future__ import annotations

import json
import os

from .cmd_common import add_overrides_argument, user_errors

HELP = "evaluate a checkpoint of a run on the validation split (perplexity vs a unigram baseline)"
LAUNCHABLE = True


def add_arguments(parser) -> None:
    parser.add_argument("--run-dir", required=True, metavar="DIR", help="a run directory written by `moe-dist train`")
    parser.add_argument("--checkpoint", metavar="PATH", help="checkpoint directory (default: the latest in DIR/checkpoints)")
    parser.add_argument("--k", metavar="K[,K...]", help="evaluate once per number of experts per token (routers with "
                        "an inference k: hyper, smoe_dropout), e.g. --k 1,2,4; results also in DIR/eval_k.json")
    add_overrides_argument(parser)


def _router_option_names(router: str) -> list[str]:
    from ..moe.routers import router_options

    return router_options(router)


def _config(args):
    from ..config import load_config

    config_path = os.path.join(args.run_dir, "config.yaml")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"--run-dir {args.run_dir!r} has no config.yaml (is it a moe-dist run directory?)")
    return load_config(config_path, [f"run.dir={args.run_dir}", *args.overrides])


def preflight(args, world_size: int) -> int:
    """Check the run directory and config before starting ``world_size`` processes."""
    return user_errors("eval", lambda: _config(args).check_world(world_size) or 0)


def _k_values(text: str) -> list[int]:
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise ValueError(f"--k {text!r}: expected positive integers separated by commas, e.g. 1,2,4")
    return ks


def run(args) -> int:
    def go() -> int:
        from .trainer import evaluate_run

        if not args.k:
            evaluate_run(_config(args), args.checkpoint)
            return 0
        ks = _k_values(args.k)
        cfg = _config(args)
        if "eval_k" not in _router_option_names(cfg.model.moe.router):
            raise ValueError(f"--k: router {cfg.model.moe.router!r} has no inference k (routers with one: hyper, smoe_dropout)")
        from ..config import load_config
        from .trainer import setup_runtime, shutdown

        rt = setup_runtime(cfg)
        try:
            results = []
            for k in ks:
                cfg_k = load_config(os.path.join(args.run_dir, "config.yaml"),
                                    [f"run.dir={args.run_dir}", *args.overrides, f"model.moe.router_options.eval_k={k}"])
                results.append({"k": k, **evaluate_run(cfg_k, args.checkpoint, rt)})
            if rt.is_main:
                with open(os.path.join(args.run_dir, "eval_k.json"), "w", encoding="utf-8") as f:
                    json.dump(results, f, indent=2)
                print("k  val_ppl  (unigram_ppl)")
                for r in results:
                    print(f"{r['k']:<2} {r['val_ppl']:8.2f}  ({r['unigram_ppl']:.2f})")
        finally:
            shutdown(rt)
        return 0

    return user_errors("eval", go)
