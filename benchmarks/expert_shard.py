"""The two splits of the experts over their replicas (``parallel.expert_shard``), paired.

    python -m benchmarks.expert_shard [--what gather,train] [--nproc 2] [--rounds 5]
        [--experts 8] [--d-model 256] [--d-ff 512] [--repeats 20] [--rows 128]
        [--config configs/tiny.yaml] [--steps 30] [--skip 5] [KEY=VALUE ...]

``gather``: on ``--nproc`` gloo processes (every rank one replica of the same experts), one layer's
experts as an FSDP2 unit split on the expert dimension and the same experts split inside them;
each round times ``--repeats`` gathers and frees (``unshard`` + ``reshard``, what FSDP2 does
around the layer's forward and backward) of one unit, then of the other (order swapped every
round), then as many forward + backward passes through each (``--rows`` rows per expert: two
gathers, the loop kernel, a reduce-scatter), and reports the rounds' times and the per-round
ratio within / experts. The split inside needs a copy after the all-gather to put every expert's
blocks back in place, and one before the reduce-scatter.

``train``: the main job (``--config``) with ``parallel.ep=1`` (every rank holds all experts, the
``edp`` ranks split them) under ``parallel.expert_shard=experts`` and ``=within``, alternating
run by run (``moe-dist train``, median tokens/s after ``--skip`` steps), and the per-round ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch

SPLITS = ("experts", "within")


def _gather_rank(rank: int, world: int, experts: int, d_model: int, d_ff: int, repeats: int, rounds: int,
                 rows_per_expert: int) -> dict:
    """Each round: ``repeats`` gathers and frees (unshard + reshard) of each split's unit, then
    ``repeats`` forward + backward passes of ``rows_per_expert`` rows per expert through it,
    alternating which split goes first."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from moe_dist.moe.experts import GroupedExperts
    from moe_dist.parallel.parallelize import expert_placement

    mesh = init_device_mesh("cpu", (world,))
    units = {}
    for split in SPLITS:
        module = GroupedExperts(experts, d_model, d_ff)
        fully_shard(module, mesh=mesh, shard_placement_fn=expert_placement(world, split), reshard_after_forward=True)
        units[split] = module
    rows = [rows_per_expert] * experts
    x = torch.randn(sum(rows), d_model, generator=torch.Generator().manual_seed(rank))

    def gather() -> None:
        unit.unshard()
        unit.reshard()

    def step() -> None:  # gathered for forward, again for backward, gradients reduce-scattered
        unit(x, rows).square().mean().backward()

    times = {f"{what} {split}": [] for what in ("gather", "step") for split in SPLITS}
    for r in range(rounds + 1):  # round 0 warms up both
        order = SPLITS if r % 2 == 0 else SPLITS[::-1]
        for what, fn in (("gather", gather), ("step", step)):
            for split in order:
                unit = units[split]
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(repeats):
                    fn()
                elapsed = time.perf_counter() - t0
                if r:
                    times[f"{what} {split}"].append(elapsed / repeats)
    return times


def _gather_worker(rank: int, world: int, out_dir: str, args: tuple) -> None:
    """One spawned rank: a gloo group through a file rendezvous; rank 0 writes its times."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'rendezvous')}", rank=rank,
                            world_size=world)
    try:
        times = _gather_rank(rank, world, *args)
        if rank == 0:
            with open(os.path.join(out_dir, "times.json"), "w", encoding="utf-8") as f:
                json.dump(times, f)
    finally:
        dist.destroy_process_group()


def bench_gather(args) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_gather_worker, args=(args.nproc, out_dir, (args.experts, args.d_model, args.d_ff,
                                                                        args.repeats, args.rounds, args.rows)),
                           nprocs=args.nproc, start_method="spawn")
        with open(os.path.join(out_dir, "times.json"), encoding="utf-8") as f:
                    times = json.load(f)  # every rank waits for the same collectives: rank 0's times stand for all
    mib = args.experts * 3 * args.d_model * args.d_ff * 4 / 2**20
    print(f"one layer's experts ({args.experts} x 3 x {args.d_model} x {args.d_ff} fp32, {mib:.1f} MiB gathered) "
          f"as an FSDP2 unit over {args.nproc} gloo ranks, {args.repeats} per round; gather: unshard + reshard; "
          f"step: forward + backward of {args.rows} rows per expert (two gathers and a reduce-scatter):")
    for what in ("gather", "step"):
        for split in SPLITS:
            t = times[f"{what} {split}"]
            print(f"  {what} {split:7s}: {' / '.join(f'{1e3 * v:.2f}' for v in t)} ms, median {1e3 * statistics.median(t):.2f}")
        ratios = [b / a for a, b in zip(times[f"{what} experts"], times[f"{what} within"])]
        print(f"  {what} within / experts per round: {' / '.join(f'{v:.3f}' for v in ratios)}, "
              f"median {statistics.median(ratios):.3f}")


def bench_train(args) -> None:
    from .train import run_case

    results = {split: [] for split in SPLITS}
    work = tempfile.mkdtemp(prefix="moe-dist-bench-expert-shard-")
    with open(os.path.join(work, "runs.log"), "w", encoding="utf-8") as log_file:
        for r in range(args.rounds):
            for split in (SPLITS if r % 2 == 0 else SPLITS[::-1]):
                out = run_case(args.config, args.nproc, args.steps, "native", "fp32",
                               ["parallel.ep=1", f"parallel.expert_shard={split}", *args.overrides],
                               os.path.join(work, split), log_file)
                tps = [v for s, v in sorted(out["tokens_per_s"].items()) if s > args.skip]
                results[split].append(statistics.median(tps))
                print(f"round {r + 1}: {split:7s} {results[split][-1]:,.0f} tokens/s (median of steps "
                      f"{args.skip + 1}-{args.steps}; {out['wall_s']:.0f} s in all)", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    ratios = [b / a for a, b in zip(results["experts"], results["within"])]
    print(f"{args.config} at {args.nproc} processes, parallel.ep=1: within / experts tokens/s per round "
          f"{' / '.join(f'{v:.3f}' for v in ratios)}, median {statistics.median(ratios):.3f}")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.expert_shard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", default="gather,train")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rows", type=int, default=128, help="rows per expert in a step of the unit")
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    p.add_argument("overrides", nargs="*", help="KEY=VALUE config overrides of the training runs")
    args = p.parse_args(argv)
    what = args.what.split(",")
    if any(w not in ("gather", "train") for w in what):
        p.error(f"--what: {args.what!r}; allowed: gather, train (comma-separated)")
    if args.d_model % args.nproc:
        p.error(f"--d-model {args.d_model} must be a multiple of --nproc {args.nproc} (the split inside the experts)")
    print(f"machine: torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{os.cpu_count()} cores", flush=True)
    if "gather" in what:
        bench_gather(args)
    if "train" in what:
        bench_train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
