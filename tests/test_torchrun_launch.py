"""moe_dist/torchrun_launch.py: which failure of a torchrun job is reported, and how (the real
torchrun's ProcessFailure records; launch/torchrun.sh end to end: tests/test_reliability.py)."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from moe_dist.exits import write_report
from moe_dist.torchrun_launch import command_of, failure_line, first_failure


def failures(*spec):
    """{rank: ProcessFailure} from (exit code, timestamp) per rank, as torchrun records them."""
    out = {}
    for rank, (code, stamp) in enumerate(spec):
        f = ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="<N/A>")
        f.timestamp = stamp
        out[rank] = f
    return out


def test_the_first_failure_leaves_out_the_workers_torchrun_stopped():
    term, kill = -signal.SIGTERM, -signal.SIGKILL
    assert first_failure(failures((2, 5), (term, 5)))[0] == 0
    assert first_failure(failures((term, 5), (2, 5)))[0] == 1  # rank 0 was stopped by torchrun after rank 1 failed
    assert first_failure(failures((1, 5), (kill, 5)))[0] == 1  # the same second: the killed rank came first
    assert first_failure(failures((1, 4), (kill, 5)))[0] == 0
    assert first_failure(failures((term, 6), (term, 5)))[0] == 1  # SIGTERM alone: the earliest


def test_a_rank_that_reported_has_spoken_for_itself(tmp_path):
    job = failures((2, 5), (-signal.SIGTERM, 5))
    assert failure_line("train", job, None) == "moe-dist train: rank 0 (pid 1000) exited with code 2; the job stopped"
    write_report(str(tmp_path), 0, {"rank": 0, "code": 2, "kind": "usage", "line": "", "traceback": ""})
    assert failure_line("train", job, str(tmp_path)) is None
    assert failure_line("eval", failures((1, 5), (-signal.SIGKILL, 5)), str(tmp_path)) == (
        "moe-dist eval: rank 1 (pid 1001) was killed by SIGKILL (out of memory?); the job stopped. resume=auto "
        "continues from the last complete checkpoint")


def test_the_command_is_the_one_the_workers_run():
    assert command_of(["--standalone", "--nproc-per-node=2", "--module", "moe_dist.cli", "eval", "--run-dir", "r"]) == "eval"
    assert command_of(["--module", "moe_dist.cli"]) == "train"


def test_a_lost_rendezvous_store_is_one_line_unless_the_ranks_reported(tmp_path):
    from moe_dist.torchrun_launch import rendezvous_endpoint, store_lost_line

    argv = ["--nnodes=2", "--rdzv-endpoint", "node0:29500", "--module", "moe_dist.cli", "train", "--config", "c.yaml"]
    assert rendezvous_endpoint(argv) == "node0:29500"
    assert rendezvous_endpoint(["--rdzv_endpoint=10.0.0.1:1234"]) == "10.0.0.1:1234"
    assert store_lost_line("train", argv, str(tmp_path)) == (
        "moe-dist train: this node's torchrun lost the job's rendezvous store at node0:29500 (the first node "
        "ended, or this node cannot reach it any more); the job stopped")
    # the node's ranks ended on their own (a preemption on every node): they have said what ended them
    write_report(str(tmp_path), 1, {"rank": 1, "code": 75, "kind": "preempted", "line": "", "traceback": ""})
    assert store_lost_line("train", argv, str(tmp_path)) is None


@pytest.mark.slow
def test_a_stop_asked_for_while_the_ranks_start_is_not_lost(tmp_path):
    """SIGTERM to launch/torchrun.sh before its rank can handle signals (what `docker stop` does to a
    container that has just started): the rank reads the launcher's note once its handler is in place,
    checkpoints after its first step and the job exits 75, instead of training on until the SIGKILL."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env.update(PYTHON=sys.executable, PYTHONPATH=root, NPROC_PER_NODE="1")
    p = subprocess.Popen(["bash", "launch/torchrun.sh", "configs/test.yaml", f"run.dir={tmp_path}/run",
                          f"data.cache_dir={tmp_path}/cache", "train.steps=400", "parallel.ep=1", "run.progress=false",
                          "run.plots=false", "eval.every=0", "eval.max_sequences=8"],
                         cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # the launcher has its trap; the rank is still importing torch
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=600)
    assert p.returncode == 75, (p.returncode, out[-2000:], err[-3000:])
    assert re.search(r"SIGUSR1 received: stopped after step 1/400, checkpoint \S+step_000001;", out), out[-2000:]
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["step_000001"]
