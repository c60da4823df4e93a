"""What a router adds to one MoE layer, measured on the router alone.

``python -m benchmarks.router`` times each router's forward + backward by itself (many
rounds, interleaved with ``topk``'s) and a few full ``topk`` layer steps, then reports the
router's extra time over ``topk`` as a share of the layer step. The layer benchmark's
``x topk`` column measures the same thing end to end, but at realistic layer sizes a step takes
seconds and varies by 10% or more between rounds on a shared machine, far more than the few
percent a router adds; the router alone runs in milliseconds and repeats cheaply. Valid for
dropless layers, where the experts do the same work whatever the router picks (the ``loop``
kernel's matmuls only change shape with the load balance).

``--compile``: every router also runs compiled as ``train.compile`` compiles it (its forward
through ``torch.compile``, inductor), in the same rotated rounds; a compiled router's extra is
taken over the compiled ``topk`` router's and divided by the step of the ``topk`` layer whose
compiled parts are compiled, so the eager and the compiled figures come from one run.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from moe_dist.distributed import ParallelGroups
from moe_dist.tuning.bf16 import slow_bf16_note
from moe_dist.moe.routers.token_graph import ENTROPY_SCAN_RANGE
from moe_dist.train.loop.compile import compile_parts, moe_layer_parts
from .cli_args import add_size_arguments, check_routers, sizes_from_args
from .impls import MoEDistImpl, _clear_grads
from .report import ROUTER_TARGETS
from .timing import busy_note, median, timed
from .workload import DTYPES, Workload


# profiler events of the token-graph routers' parts -> their names in the report
PARTS = {ENTROPY_SCAN_RANGE: "entropy scan", "_GraphMix": "mixing forward", "_GraphMixBackward": "mixing backward"}


def part_times(step, rounds: int = 5) -> dict:
    """Milliseconds per step in each of :data:`PARTS` (torch.profiler; 0 for a part the router
    does not run). The profiler adds a little to every op, so these are shares, not timings."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(rounds):
            step()
    totals = {name: 0.0 for name in PARTS.values()}
    for event in prof.key_averages():
        if event.key in PARTS:
            totals[PARTS[event.key]] += event.cpu_time_total / rounds / 1e3
    return totals


class RouterStep:
    """One router's forward and backward on a layer's inputs: the gates get a fixed random
    upstream gradient (what the combine step would send) and the probabilities the
    load-balance loss's (mean over tokens, as in the layer's share)."""

    def __init__(self, impl: MoEDistImpl, grad_gates: torch.Tensor):
        self.impl, self.grad_gates = impl, grad_gates
        self.params = [p for p in impl.layer.router.parameters() if p.requires_grad]

    def __call__(self) -> None:
        _clear_grads(self.params + [self.impl.x])
        layer = self.impl.layer
        layer.context.step += 1
        x2 = self.impl.x.reshape(-1, layer.d_model)
        routing = layer.router(x2, layer.context, self.impl.inputs)
        loss = (routing.gates * self.grad_gates[:, : routing.gates.shape[1]]).sum() + routing.probs.mean()
        loss.backward()


COMPILED = " (compiled)"  # the name suffix of a compiled router's entries


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--routers", default="similarity,attention,symphony", help="routers compared with topk")
    p.add_argument("--router-options", type=json.loads, default={}, help="JSON: router name -> options")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="the layer's dtype (routers compute in fp32)")
    add_size_arguments(p)
    p.add_argument("--router-repeats", type=int, default=15, help="timed rounds of the routers alone")
    p.add_argument("--layer-repeats", type=int, default=3, help="timed full topk layer steps (the denominator)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu", help="torch device type (cpu, cuda, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object per router on stdout")
    p.add_argument("--compile", action="store_true",
                   help="also time every router compiled (train.compile's torch.compile), paired with the eager ones")
    p.add_argument("--parts", action="store_true",
                   help="also profile each router's token-graph parts (entropy scan, mixing forward and backward)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    routers = [r for r in args.routers.split(",") if r and r != "topk"]
    check_routers(routers)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = sizes_from_args(args)
    work = Workload(sizes, args.tokens, DTYPES[args.dtype], device, args.seq_len, 0.0, args.seed)
    groups = ParallelGroups.single()
    impls = {name: MoEDistImpl(work, name, groups, args.router_options.get(name), "loop") for name in ["topk"] + routers}
    variants = [""]
    if args.compile:
        variants.append(COMPILED)
        for name in ["topk"] + routers:
            impl = impls[name + COMPILED] = MoEDistImpl(work, name, groups, args.router_options.get(name), "loop")
            # the router itself even where train.compile leaves it eager (eager_under_compile: measured here)
            forced = [("router", impl.layer.router, False)] if impl.layer.router.eager_under_compile else []
            compile_parts(forced + moe_layer_parts(impl.layer))
    gen = torch.Generator().manual_seed(args.seed + 3)
    grad_gates = torch.randn(args.tokens, args.top_k, generator=gen).to(device)
    steps = {name: RouterStep(impl, grad_gates) for name, impl in impls.items()}
    print(f"router benchmark: {sizes}, {args.dtype}, {args.tokens} tokens in sequences of {args.seq_len}, "
          f"{torch.get_num_threads()} thread(s), CPU capability {torch.backends.cpu.get_cpu_capability()}",
          file=sys.stderr)
    slow = slow_bf16_note(device, args.dtype)
    if slow:
        print(slow, file=sys.stderr)
    busy = busy_note(1, "at the start")
    if busy:
        print(busy, file=sys.stderr)

    layer_s = {}
    for v in variants:
        impls["topk" + v].step()  # warm-up (and compilation), then the denominator
        layer_s[v] = median([timed(impls["topk" + v].step, device)[0] for _ in range(args.layer_repeats)])
    for step in steps.values():
        step()
        step()  # a compiled router compiles in the first call (its backward too)
    names = list(steps)
    times = {name: [] for name in names}
    for r in range(args.router_repeats):  # rounds in a rotated order
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(timed(steps[name], device)[0])
    for v in variants:
        print(f"topk layer forward+backward{v}: {1e3 * layer_s[v]:.1f} ms (median of {args.layer_repeats}); "
              f"topk router alone{v}: {1e3 * median(times['topk' + v]):.2f} ms", file=sys.stderr)
    for name, v in [(name, v) for name in routers for v in variants]:
        base = times["topk" + v]
        extra = median([a - b for a, b in zip(times[name + v], base)])  # paired per round
        share = extra / layer_s[v]
        rec = {"router": name, "compiled": bool(v), "router_ms": 1e3 * median(times[name + v]),
               "topk_router_ms": 1e3 * median(base),
               "extra_ms": 1e3 * extra, "topk_layer_ms": 1e3 * layer_s[v], "overhead": share,
               "seq_len": args.seq_len, "tokens": args.tokens, "dtype": args.dtype, "d_model": sizes.d_model, "d_ff": sizes.d_ff,
               "heads": sizes.heads, "kv_heads": sizes.kv_heads or sizes.heads, "threads": torch.get_num_threads(),
               "cpu_capability": torch.backends.cpu.get_cpu_capability()}
        limit = ROUTER_TARGETS.get(name)
        verdict = "" if limit is None else (" met " if 1 + share <= limit else " MISS") + f" (<= {limit - 1:+.0%})"
        print(f"{name + v:>20}: alone {rec['router_ms']:.2f} ms, extra over topk {rec['extra_ms']:.2f} ms = "
              f"{share:+.1%} of the topk layer step{verdict}", file=sys.stderr)
        if args.parts and not v:
            rec["parts_ms"] = part_times(steps[name])
            if any(rec["parts_ms"].values()):
                print(" " * 13 + "profiled parts per step: " + ", ".join(f"{part} {ms:.1f} ms"
                                                                  for part, ms in rec["parts_ms"].items()), file=sys.stderr)
        if args.json:
            print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
