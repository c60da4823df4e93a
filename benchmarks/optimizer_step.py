"""The optimizer step alone: foreach AdamW against fused AdamW on a config's model.

    python -m benchmarks.optimizer_step [--config configs/tiny.yaml] [--threads 1] [--steps 10]
        [--rounds 3] [KEY=VALUE ...]

The model is built whole in one process (the parameters of every rank together), its
gradients filled with small random values, and each round times ``--steps`` optimizer steps of
both implementations, alternating, on the parameter groups the trainer makes
(:func:`moe_dist.train.loop.optim.build_optimizer`'s, with the implementation forced). Prints the
median milliseconds per step of each round and their ratio.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Optional

import torch

from moe_dist.config import load_config
from moe_dist.model import build_model
from moe_dist.train.loop.optim import build_optimizer
from .timing import say_if_busy


def _with_implementation(optimizer: torch.optim.AdamW, fused: bool) -> torch.optim.AdamW:
    groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in optimizer.param_groups]
    return torch.optim.AdamW(groups, fused=fused, foreach=None if fused else True)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.optimizer_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=10, help="timed steps per implementation and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, list(args.overrides))
    model = build_model(cfg.model, cfg.model.vocab_size or cfg.data.vocab_size, seed=cfg.train.seed)
    gen = torch.Generator().manual_seed(0)
    for w in model.parameters():
        w.grad = torch.randn(w.shape, generator=gen) * 1e-3
    n = sum(w.numel() for w in model.parameters())
    print(f"optimizer step: {args.config}, {n / 1e6:.1f}M parameters, {torch.get_num_threads()} thread(s), "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    say_if_busy(1, "at the start")
    base = build_optimizer(model, cfg.train)
    optimizers = {"foreach": _with_implementation(base, False), "fused": _with_implementation(base, True)}
    for opt in optimizers.values():
        opt.step()  # the state is made in the first step
    ratios = []
    for r in range(args.rounds):
        ms = {}
        for name in (list(optimizers) if r % 2 == 0 else list(optimizers)[::-1]):
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                optimizers[name].step()
                times.append(time.perf_counter() - t0)
            ms[name] = 1e3 * statistics.median(times)
        ratios.append(ms["foreach"] / ms["fused"])
        print(f"round {r + 1}: foreach {ms['foreach']:.1f} ms, fused {ms['fused']:.1f} ms per step "
              f"(foreach / fused {ratios[-1]:.2f})", flush=True)
    print(f"foreach / fused: median {statistics.median(ratios):.2f} over {args.rounds} rounds")
    say_if_busy(1, "at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
