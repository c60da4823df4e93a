"""``python -m benchmarks.gpu_check``: the command line (see the package's docstring)."""
from __future__ import annotations

import argparse
import os
import sys

from .runner import run_all, run_section
from .settings import ROOT, SECTIONS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check",
                                description="The first run on a GPU: the device, the layer and routers against the CPU, "
                                "training (tokens/s, MFU, memory), memory against the dry run, host syncs per step, "
                                "the expert kernels against the floor (see the module's docstring).")
    p.add_argument("--out", required=True, help="gpu_check.json, gpu_check.md, sections.log")
    p.add_argument("--work", default=None, help="the runs, caches and per-section results (default: "
                   "runs/gpu-check-work in the repository)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: small sizes (this check's own test)")
    p.add_argument("--quick", action="store_true", help="fewer steps and smaller cases (on the CPU: no TinyLlama slice)")
    p.add_argument("--budget-s", type=float, default=450.0, help="seconds for all sections together")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated, run in this order: {','.join(SECTIONS)}")
    p.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)  # internal: run one section in this process
    p.add_argument("--limit-s", type=float, default=600.0, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.budget_s <= 0:
        parser().error(f"--budget-s {args.budget_s:g}: allowed: a number of seconds > 0")
    args.out = os.path.abspath(args.out)
    args.work = os.path.abspath(args.work or os.path.join(ROOT, "runs", "gpu-check-work"))
    if args.section:
        return run_section(args.section, args)
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
