"""One rank of a heartbeat test: ``python heartbeat_case.py MODE HEARTBEAT_S`` under RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT. The rank joins the job through the project's bootstrap (gloo, the TCP
store at MASTER_ADDR:MASTER_PORT, the heartbeat), prints ``ready``, then:

* ``loop``: all-reduces forever (a peer that stops answering holds it there, as in training);
* ``finish:S``: all-reduces for S seconds, then shuts down normally (rank 0 first: it waits
  ``2 x HEARTBEAT_S`` before its shutdown barrier, so its peers sit in that barrier meanwhile).
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from moe_dist.distributed.bootstrap import init_distributed, shutdown
from moe_dist.exits import end_process, run_process


def main() -> int:
    mode, heartbeat_s = sys.argv[1], float(sys.argv[2])
    rt = init_distributed(1, backend="gloo", device="cpu", timeout_s=600, heartbeat_timeout_s=heartbeat_s,
                          on_lost_peer=lambda line: end_process(line, kind="lost_peer"))  # as the trainer does
    x = torch.ones(4)
    dist.all_reduce(x)
    print("ready", flush=True)
    until = time.monotonic() + (float(mode.split(":")[1]) if mode.startswith("finish:") else 1e9)
    while time.monotonic() < until:
        dist.all_reduce(x)
        time.sleep(0.05)
    if rt.launch.rank == 0:
        time.sleep(2 * heartbeat_s)
    shutdown(rt)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(run_process("train", main))
