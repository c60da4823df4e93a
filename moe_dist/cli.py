"""The ``moe-dist`` command line.

    moe-dist train --config configs/tiny.yaml --nproc 2 [KEY=VALUE ...]
    moe-dist eval --run-dir runs/tiny [--nproc N] [KEY=VALUE ...]

Each subcommand lives in its own module, named in :data:`COMMANDS`; the module defines
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``, and sets
``LAUNCHABLE = True`` if it runs as one rank of a distributed job. For those, this module
adds ``--nproc N``: start N local processes (:mod:`moe_dist.local_launch`: it forwards signals
and keeps the job's exit code) running the same command without ``--nproc``; an optional
``preflight(args, world_size) -> int`` checks the arguments first (non-zero = do not launch). Without it the command is one rank of whatever
launched it (torchrun, srun, mpirun) or a single process. Adding a subcommand = one line
in COMMANDS plus its module. Options and ``KEY=VALUE`` overrides may come in any order.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
from typing import Optional, Sequence

COMMANDS: dict[str, str] = {
    "train": "moe_dist.commands.train",
    "eval": "moe_dist.commands.eval",
    "convert": "moe_dist.commands.convert",
    "upcycle": "moe_dist.commands.upcycle",
    "import": "moe_dist.commands.import_",
    "export": "moe_dist.commands.export",
    "plan": "moe_dist.commands.plan",
    "sweep": "moe_dist.commands.sweep",
    "prepare": "moe_dist.commands.prepare",
}


def _strip_nproc(argv: Sequence[str]) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``only`` alone: a command's module is imported only when its
    parser is built, so the launcher of ``train --nproc N`` does not import what other commands need
    (some import torch, seconds of start-up on a small machine)."""
    parser = argparse.ArgumentParser(prog="moe-dist", description="Expert-parallel Mixture-of-Experts training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        if only is not None and name != only:
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        if getattr(module, "LAUNCHABLE", False):
            p.add_argument("--nproc", type=int, default=None, metavar="N",
                           help="start N local processes (torchrun-style); without it, run as one rank of the "
                                "current torchrun / srun / mpirun launch, or as a single process")
        p.set_defaults(_module=module, command=name)
    parser.commands = sub.choices  # name -> its parser, for parse_args below
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """The command's options and ``KEY=VALUE`` overrides in any order (``train --config C a=1 --nproc 2
    b=2``): the command's parser reads its arguments intermixed; anything else (no command, ``-h``,
    an unknown command) goes to the top parser, which prints help or the error."""
    if argv and argv[0] in parser.commands:
        return parser.commands[argv[0]].parse_intermixed_args(argv[1:])
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parse_args(parser, argv)
    if getattr(args, "command", None) is None:
        parser.print_help()
        return 2
    nproc = getattr(args, "nproc", None)
    if nproc is not None:
        if nproc < 1:
            parser.error(f"--nproc must be >= 1, got {nproc}")
        preflight = getattr(args._module, "preflight", None)
        code = preflight(args, nproc) if preflight else 0
        if code:
            return code
        from .local_launch import launch_local
        from .train.setup.runtime import THREADS_DEFAULTED

        defaulted = "OMP_NUM_THREADS" not in os.environ  # then the launcher's value is a default, not the user's
        if defaulted:
            os.environ[THREADS_DEFAULTED] = "1"
        try:
            return launch_local(nproc, _strip_nproc(argv), args.command)
        finally:
            if defaulted:
                os.environ.pop(THREADS_DEFAULTED, None)
    from .exits import run_process

    code = run_process(args.command, lambda: args._module.run(args))
    # a model sharded over a device mesh keeps the mesh, and the mesh its process groups:
    # free them now, while the interpreter is whole (see distributed.bootstrap.shutdown)
    gc.collect()
    return code


if __name__ == "__main__":
    sys.exit(main())
