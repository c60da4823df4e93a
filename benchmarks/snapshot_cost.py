"""What in-memory snapshots (ckpt.memory_every) cost the main job: paired runs of
``moe-dist train --config configs/tiny.yaml --nproc 2`` without and with a snapshot every ``--every`` steps,
alternated (A B, B A, A B, ...), each run's loop time per step and its phases (summary.json ``time``).

    python -m benchmarks.snapshot_cost --steps 60 --pairs 2 [--every 1] [--out /tmp/snapcost] [override ...]

Prints the machine (CPU capability, cores, load average) and per pair the seconds per step of the
loop, of the training step itself (does the background work slow it?), of the checkpoint phase
(the synchronous copy), the CPU seconds per step of the whole run (both ranks and the launcher,
start-up included, so the ratio understates a little: the figure least moved by other load on a
shared machine), and the ratios with/without; then the medians.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

import torch


def one_run(out: str, name: str, steps: int, every: int, extra: list[str]) -> dict:
    run = os.path.join(out, name)
    cmd = [sys.executable, "-m", "moe_dist.cli", "train", "--config", "configs/tiny.yaml", "--nproc", "2",
           f"run.dir={run}", f"train.steps={steps}", f"ckpt.memory_every={every}", "ckpt.save_final=false",
           "run.plots=false", "run.tensorboard=false", "run.progress=false", "resume=none", *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run(cmd, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    with open(os.path.join(run, "summary.json"), encoding="utf-8") as f:
        time = json.load(f)["time"]
    with open(os.path.join(run, "metrics.jsonl"), encoding="utf-8") as f:
        losses = [json.loads(line)["loss"] for line in f if line.strip()]
    sec = time["seconds"]
    return {"loop": time["wall_s"] / steps, "step": sec.get("step", 0.0) / steps,
            "checkpoint": sec.get("checkpoint", 0.0) / steps, "cpu": cpu / steps, "losses": losses}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--every", type=int, default=1, help="ckpt.memory_every of the runs with snapshots")
    p.add_argument("--out", default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="snapshot-cost-")
    print(f"machine: torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    ratios, cpu_ratios = [], []
    for i in range(args.pairs):
        if i % 2 == 0:  # A B, then B A: the order within a pair does not favour either side
            off = one_run(out, f"off{i}", args.steps, 0, args.overrides)
            on = one_run(out, f"on{i}", args.steps, args.every, args.overrides)
        else:
            on = one_run(out, f"on{i}", args.steps, args.every, args.overrides)
            off = one_run(out, f"off{i}", args.steps, 0, args.overrides)
        same = off["losses"] == on["losses"]
        ratio = on["loop"] / off["loop"]
        ratios.append(ratio)
        cpu_ratios.append(on["cpu"] / off["cpu"])
        print(f"pair {i} ({'off, on' if i % 2 == 0 else 'on, off'}): s/step loop {off['loop']:.3f} -> {on['loop']:.3f} (x{ratio:.3f}), training step "
              f"{off['step']:.3f} -> {on['step']:.3f} (x{on['step'] / off['step']:.3f}), checkpoint phase "
              f"{1e3 * off['checkpoint']:.1f} -> {1e3 * on['checkpoint']:.1f} ms, CPU s/step {off['cpu']:.3f} -> "
              f"{on['cpu']:.3f} (x{cpu_ratios[-1]:.3f}); losses identical: {same}; "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print(f"snapshot every {args.every} step(s): the loop's time per step x{statistics.median(ratios):.3f}, CPU per "
          f"step x{statistics.median(cpu_ratios):.3f} (medians of {len(ratios)} pair(s) of {args.steps} steps; load "
          f"average {os.getloadavg()[0]:.1f} at the end)")


if __name__ == "__main__":
    main()
