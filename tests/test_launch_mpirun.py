"""launch/mpirun.sh with 2 MPI ranks (the ``mpich`` wheel of the ``mpi`` extra gives ``mpirun``).

The ranks find their place from the MPI launcher's environment, train configs/test.yaml, and a
SIGUSR1 sent to the script reaches them through mpirun: they checkpoint at the next step
boundary and the script exits with 75.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "launch", "mpirun.sh")
MPI_LAUNCHERS = ("mpi4py", "mpich", "openmpi", "pmix", "mvapich")  # mpi4py: MOE_DIST_MPI4PY=1 (the script sets it)


def _mpirun() -> str:
    local = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return local if os.access(local, os.X_OK) else (shutil.which("mpirun") or "")


def _rows(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def test_mpirun_two_ranks_train_then_stop_on_signal(tmp_path):
    mpirun = _mpirun()
    if not mpirun:
        pytest.skip("no mpirun next to the interpreter or on PATH: install the mpi extra (pip install -e '.[mpi]')")
    run_dir = str(tmp_path / "run")
    steps = 200
    cmd = ["bash", SCRIPT, "-n", "2", "configs/test.yaml", f"run.dir={run_dir}", f"train.steps={steps}",
           "run.progress=false", "run.plots=false", "run.tensorboard=false", "run.print_every=1"]
    env = {**os.environ, "PYTHON": sys.executable, "MPIRUN": mpirun}
    log_path = tmp_path / "mpirun.log"
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            metrics = os.path.join(run_dir, "metrics.jsonl")
            deadline = time.time() + 240
            while _rows(metrics) < 3:
                assert proc.poll() is None, f"mpirun.sh ended early ({proc.returncode}):\n{log_path.read_text()[-3000:]}"
                assert time.time() < deadline, f"no 3 training steps in 240 s:\n{log_path.read_text()[-3000:]}"
                time.sleep(0.3)
            t_steps = time.time() - t0
            proc.send_signal(signal.SIGUSR1)
            rc = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    out = log_path.read_text()
    assert rc == 75, out[-3000:]
    m = re.search(r"SIGUSR1 received: stopped after step (\d+)/%d" % steps, out)
    assert m, out[-3000:]
    stopped = int(m.group(1))
    assert 3 <= stopped < steps
    with open(os.path.join(run_dir, "run.json")) as f:
        info = json.load(f)
    assert info["world_size"] == 2 and info["launcher"] in MPI_LAUNCHERS, info
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, stopped + 1))
    assert all(0 < r["loss"] < 20 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]
    ckpt = os.path.join(run_dir, "checkpoints", f"step_{stopped:06d}")
    assert os.path.exists(os.path.join(ckpt, "COMPLETE")), os.listdir(os.path.dirname(ckpt))
    print(f"\nmpirun 2 ranks ({info['launcher']}): 3 steps after {t_steps:.1f}s, stopped at step {stopped}, "
          f"total {time.time() - t0:.1f}s")
