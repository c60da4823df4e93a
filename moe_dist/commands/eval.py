"""``moe-dist eval``: validation perplexity of a run's checkpoint next to a unigram baseline."""
from __future__ import annotations

import os
from typing import Optional

from ..errors import MissingInputError, UsageError
from ..safe_io import write_json_atomically
from .common import add_overrides_argument, is_rank0, run_config_path, user_errors

HELP = "evaluate a checkpoint on the validation split (perplexity vs a unigram baseline)"
LAUNCHABLE = True


def add_arguments(parser) -> None:
    parser.add_argument("--run-dir", metavar="DIR", help="a run directory written by `moe-dist train` (its config.yaml; "
                        "results go to DIR/eval.json)")
    parser.add_argument("--checkpoint", metavar="PATH", help="a training checkpoint (default: the latest in "
                        "DIR/checkpoints) or a model directory written by `moe-dist upcycle` / `convert` (config.yaml "
                        "next to the safetensors weights; then --run-dir is not needed), e.g. the step-0 perplexity of "
                        "an upcycled model")
    parser.add_argument("--json", metavar="FILE", help="also write the result (perplexities, tokens, layout, peak "
                        "memory of every rank) to FILE")
    parser.add_argument("--k", metavar="K[,K...]", help="evaluate once per number of experts per token (routers with "
                        "an inference k option, eval_k), e.g. --k 1,2,4; results also in DIR/eval_k.json")
    add_overrides_argument(parser)


def _config_path(args) -> str:
    """The config of what is evaluated: the run directory's, else the model directory's."""
    if args.run_dir:
        return run_config_path(args.run_dir)
    if not args.checkpoint:
        raise UsageError("eval: give --run-dir DIR (a training run) or --checkpoint DIR (a model directory written by "
                         "`moe-dist upcycle` or `moe-dist convert`)")
    path = os.path.join(args.checkpoint, "config.yaml")
    if not os.path.isdir(args.checkpoint):
        raise MissingInputError(f"--checkpoint {args.checkpoint!r}: no such directory")
    if not os.path.exists(path):
        raise MissingInputError(f"--checkpoint {args.checkpoint!r} has no config.yaml; a training checkpoint needs "
                                "--run-dir (its run's config), a model directory needs the config.yaml that "
                                "`moe-dist upcycle` / `convert` write next to the weights")
    return path


def _sets_ep(overrides: list[str]) -> bool:
    """Whether the user chose ``parallel.ep`` on the command line."""
    from ..config import parse_override

    for text in overrides:
        key, value = parse_override(text)
        if key == "parallel.ep" or (key == "parallel" and isinstance(value, dict) and "ep" in value):
            return True
    return False


def _config(args, *extra: str, world_size: Optional[int] = None):
    """The config of what is evaluated, with the overrides; ``parallel.ep`` fits the evaluation's
    processes (:func:`~moe_dist.train.evaluation.saved.evaluation_ep`) unless the command line sets it or it is ``auto``."""
    from ..config import load_config
    from ..config.layout import AUTO
    from ..train.evaluation.saved import evaluation_ep, evaluation_world_size

    run_dir = [f"run.dir={args.run_dir}"] if args.run_dir else []
    overrides = [*run_dir, *args.overrides, *extra]
    cfg = load_config(_config_path(args), overrides)
    if not _sets_ep(overrides) and cfg.parallel.ep != AUTO:  # auto fits any number of processes
        ep = evaluation_ep(cfg.parallel.ep, world_size or evaluation_world_size())
        if ep != cfg.parallel.ep:
            cfg = load_config(_config_path(args), [*overrides, f"parallel.ep={ep}"])
    return cfg


def preflight(args, world_size: int) -> int:
    """Check the run directory and config before starting ``world_size`` processes."""
    def check() -> int:
        from ..train.setup.preflight import check_before_launch

        check_before_launch(_config(args, world_size=world_size), world_size, training=False)
        return 0

    return user_errors("eval", check)


def _k_values(text: str) -> list[int]:
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise UsageError(f"--k {text!r}: expected positive integers separated by commas, e.g. 1,2,4")
    return ks


def _write_json(path, result) -> None:
    if path and is_rank0():
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_json_atomically(path, result, indent=2)


def run(args) -> int:
    def go() -> int:
        from ..distributed.bootstrap import shutdown
        from ..train.evaluation.saved import check_inference_k, evaluate_per_k, evaluate_run, reading_run_dir
        from ..train.setup.runtime import setup_runtime

        cfg = _config(args)
        ks = _k_values(args.k) if args.k else None
        if ks:
            check_inference_k(cfg.model.moe.router)
        rt = setup_runtime(cfg)
        try:
            with reading_run_dir(args.run_dir, rt):
                if ks is None:  # eval.json into a run directory; a bare model directory is only read
                    _write_json(args.json, evaluate_run(cfg, args.checkpoint, rt, write_json=bool(args.run_dir)))
                else:
                    _write_json(args.json, evaluate_per_k(lambda k: _config(args, f"model.moe.router_options.eval_k={k}"),
                                                          ks, args.checkpoint, rt, args.run_dir))
        finally:
            shutdown(rt)
        return 0

    return user_errors("eval", go)
