"""Where a training step's time goes, op by op: eager against ``train.compile``, or fp32 against bf16.

    python -m benchmarks.step_profile [--config configs/tiny.yaml] [--batch 6] [--threads 1]
        [--compare compile|dtype] [--dtype fp32] [--rounds 5] [--top 15] [KEY=VALUE ...]

One process, one thread (one rank of the main job: ``--batch`` sequences of ``train.seq_len``,
all experts local, so no exchange): the model is built twice from the same seed. ``--compare
compile`` (the default): one copy compiled as the trainer compiles it
(:func:`moe_dist.train.loop.compile.apply_compile`), both in ``--dtype``. ``--compare dtype``: both
eager, one in fp32 and one under bf16 autocast, as the trainer runs ``train.dtype`` (with
``train.attention_dtype`` decided as the trainer decides it). After a
warm-up (the compilation), rounds alternate between the two; each round times one forward +
backward (the loss as the trainer forms it, no optimizer step). Then a few steps of each run
under ``torch.profiler``, and the ops with the most self time are listed side by side (ms per
step): what the compiled step no longer runs (the fused elementwise ops) and what it still runs
(matmuls, SDPA, the MoE layer's eager middle); or which ops bf16 speeds up, which it slows down
and which it adds (autocast's casts).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Optional

import torch
import torch.nn.functional as F

from moe_dist.config import load_config
from moe_dist.tuning.bf16 import slow_bf16_note
from moe_dist.model import build_model
from moe_dist.moe import collect_aux_loss
from moe_dist.tuning.attention import decide_attention_dtype
from moe_dist.train.loop.compile import apply_compile
from .timing import say_if_busy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def step_fn(model, tokens: torch.Tensor, dtype: str):
    def step() -> None:
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) + collect_aux_loss(model)
        loss.backward()
    return step


def op_times(step, steps: int) -> dict[str, float]:
    """Self CPU milliseconds per step of every op (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    return {e.key: e.self_cpu_time_total / steps / 1e3 for e in prof.key_averages()}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--batch", type=int, default=6, help="sequences per step (one rank's share of the main job)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compare", choices=("compile", "dtype"), default="compile",
                   help="compile: eager against compiled in --dtype; dtype: fp32 against bf16, eager")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, eager and compiled alternating")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, list(args.overrides))
    vocab = cfg.model.vocab_size or cfg.data.vocab_size
    # (name, dtype, compiled) of the two runs compared
    runs = ([("eager", args.dtype, False), ("compiled", args.dtype, True)] if args.compare == "compile"
            else [("fp32", "fp32", False), ("bf16", "bf16", False)])
    dtypes = sorted({dtype for _, dtype, _ in runs})
    print(f"step profile: {args.config}, {args.batch} x {cfg.train.seq_len} tokens, {' and '.join(dtypes)}, "
          f"{torch.get_num_threads()} thread(s), CPU capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    for dtype in dtypes:
        slow = slow_bf16_note(torch.device("cpu"), dtype)
        if slow:
            print(slow, flush=True)
    say_if_busy(1, "at the start")
    tokens = torch.randint(0, vocab, (args.batch, cfg.train.seq_len + 1), generator=torch.Generator().manual_seed(0))
    steps = {}
    for name, dtype, compiled in runs:
        model = build_model(cfg.model, vocab, seed=cfg.train.seed).train()
        decision = decide_attention_dtype(model, cfg.train.attention_dtype, dtype, args.batch, cfg.train.seq_len,
                                          torch.device("cpu"))
        if decision is not None:
            print(f"{name}: {decision.describe()}", flush=True)
        if compiled:
            apply_compile(model)
        steps[name] = step_fn(model, tokens, dtype)
        t0 = time.perf_counter()
        steps[name]()
        steps[name]()
        print(f"{name}: first two steps {time.perf_counter() - t0:.1f} s"
              + (" (it compiles in them)" if compiled else ""), flush=True)
    times = {name: [] for name in steps}
    for r in range(args.rounds):
        for name in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
    a, b = list(steps)
    ratios = [x / y for x, y in zip(times[a], times[b])]
    print(f"step (forward + backward): {a} {1e3 * statistics.median(times[a]):.1f} ms, {b} "
          f"{1e3 * statistics.median(times[b]):.1f} ms (medians of {args.rounds}); {a} / {b} per round: "
          f"{' '.join(f'{v:.3f}' for v in ratios)}, median {statistics.median(ratios):.3f}", flush=True)
    ops = {name: op_times(step, args.profile_steps) for name, step in steps.items()}
    keys = sorted(set(ops[a]) | set(ops[b]), key=lambda k: -max(ops[a].get(k, 0.0), ops[b].get(k, 0.0)))
    print(f"\n| op (self CPU time, ms per step; profiler on) | {a} | {b} |\n|---|---|---|")
    for k in keys[: args.top]:
        print(f"| `{k}` | {ops[a].get(k, 0.0):.1f} | {ops[b].get(k, 0.0):.1f} |")
    print(f"| all ops | {sum(ops[a].values()):.1f} | {sum(ops[b].values()):.1f} |")
    say_if_busy(1, "at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
