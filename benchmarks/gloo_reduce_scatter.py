"""What gloo's reduce-scatter holds beside its input: the figure behind the planner's gloo copy
(:func:`moe_dist.plan.memory.reduce_scatter_bytes`). Each of ``--ranks`` gloo processes on this
machine reduce-scatters an fp32 tensor of ``--mib`` MiB and prints the growth of its peak resident
memory during the call over the input's size (1.0: one copy of the input).

    .venv/bin/python -m benchmarks.gloo_reduce_scatter            # --ranks 2 --mib 64
"""
from __future__ import annotations

import argparse
import os
import resource
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _rank(rank: int, world: int, port: int, numel: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, y = torch.ones(numel), torch.zeros(numel // world)  # touched: resident before the call
    dist.barrier()
    before = _peak_rss()
    dist.reduce_scatter_tensor(y, x)
    out.put((rank, (_peak_rss() - before) / (numel * 4)))
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    numel = (args.mib << 20) // 4 // args.ranks * args.ranks
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, numel, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    growth = sorted(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    print(f"torch {torch.__version__}, CPU {torch.backends.cpu.get_cpu_capability()}, {args.ranks} gloo ranks, "
          f"{args.mib} MiB fp32 input: peak resident growth during reduce_scatter_tensor / input = "
          + ", ".join(f"rank {r}: {g:.3f}" for r, g in growth))


if __name__ == "__main__":
    main()
