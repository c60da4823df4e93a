"""``moe-dist eval``: validation perplexity of a run's checkpoint next to a unigram baseline."""
from __future__ import annotations

import contextlib
import os
from typing import Optional

from .cmd_common import add_overrides_argument, run_config_path, user_errors
from ..errors import MissingInputError, UsageError
from ..safe_io import write_json_atomically

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


def _has_inference_k(router: str) -> bool:
    from ..moe.routers import ROUTERS

    return ROUTERS[router].has_inference_k


def _routers_with_inference_k() -> list[str]:
    from ..moe.routers import ROUTERS

    return sorted(name for name, cls in ROUTERS.items() if cls.has_inference_k)


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


def evaluation_ep(trained_ep, world_size: int):
    """The expert-parallel size of an evaluation on ``world_size`` processes: the training's when it
    divides them, else ``auto``, the rule a training run continued on another layout follows
    (:mod:`moe_dist.config.layout`). Checkpoints are keyed by global expert, so they load at any
    expert-parallel size."""
    from ..config.layout import AUTO

    return trained_ep if trained_ep == AUTO or world_size % trained_ep == 0 else AUTO


def _sets_ep(overrides: list[str]) -> bool:
    """Whether the user chose ``parallel.ep`` on the command line."""
    from ..config import parse_override

    for text in overrides:
        key, value = parse_override(text)
        if key == "parallel.ep" or (key == "parallel" and isinstance(value, dict) and "ep" in value):
            return True
    return False


def _world_size() -> int:
    """The number of processes of this evaluation: the process group's, else the launcher's environment's."""
    import torch.distributed as dist

    from ..distributed.bootstrap import detect_launch

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return detect_launch().world_size


def _config(args, *extra: str, world_size: Optional[int] = None):
    """The config of what is evaluated, with the overrides; ``parallel.ep`` fits the evaluation's
    processes (:func:`evaluation_ep`) unless the command line sets it or it is ``auto``."""
    from ..config import load_config
    from ..config.layout import AUTO

    run_dir = [f"run.dir={args.run_dir}"] if args.run_dir else []
    overrides = [*run_dir, *args.overrides, *extra]
    cfg = load_config(_config_path(args), overrides)
    if not _sets_ep(overrides) and cfg.parallel.ep != AUTO:  # auto fits any number of processes
        ep = evaluation_ep(cfg.parallel.ep, world_size or _world_size())
        if ep != cfg.parallel.ep:
            cfg = load_config(_config_path(args), [*overrides, f"parallel.ep={ep}"])
    return cfg


def preflight(args, world_size: int) -> int:
    """Check the run directory and config before starting ``world_size`` processes."""
    def check() -> int:
        from .preflight import check_before_launch

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
    from .cmd_common import is_rank0

    if path and is_rank0():
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_json_atomically(path, result, indent=2)


@contextlib.contextmanager
def _reading(run_dir: Optional[str], rt):
    """Hold the run directory's read lock while the ranks read it (rank 0 takes it for all): a run
    may train there meanwhile, but none starts, resumes or prunes checkpoints (see run_lock)."""
    from .checkpoint.collective import broadcast
    from .run_lock import RunDirReadLock

    lock = RunDirReadLock(run_dir) if run_dir and rt.is_main else None
    refusal = broadcast(lock.acquire() if lock else None, None)
    if refusal:
        raise UsageError(refusal)
    try:
        yield
    finally:
        if lock:
            lock.release()


def run(args) -> int:
    def go() -> int:
        from ..distributed.bootstrap import shutdown
        from .eval_run import evaluate_run
        from .runtime import setup_runtime

        write = bool(args.run_dir)  # a bare model directory is only read
        cfg = _config(args)
        ks = _k_values(args.k) if args.k else None
        if ks and not _has_inference_k(cfg.model.moe.router):
            raise UsageError(f"--k: router {cfg.model.moe.router!r} has no inference k (routers with one: "
                             f"{', '.join(_routers_with_inference_k())})")
        rt = setup_runtime(cfg)
        try:
            with _reading(args.run_dir, rt):
                if ks is None:
                    _write_json(args.json, evaluate_run(cfg, args.checkpoint, rt, write_json=write))
                    return 0
                results = []
                for k in ks:
                    cfg_k = _config(args, f"model.moe.router_options.eval_k={k}")
                    results.append({"k": k, **evaluate_run(cfg_k, args.checkpoint, rt, write_json=write)})
                if rt.is_main and write:
                    write_json_atomically(os.path.join(args.run_dir, "eval_k.json"), results, indent=2)
                _write_json(args.json, results)
                if rt.is_main:
                    print("k  val_ppl  (unigram_ppl)")
                    for r in results:
                        print(f"{r['k']:<2} {r['val_ppl']:8.2f}  ({r['unigram_ppl']:.2f})")
        finally:
            shutdown(rt)
        return 0

    return user_errors("eval", go)
