"""`moe-dist train --nproc 2` stopped by SIGTERM (what `docker stop` sends to a container's
PID 1): the launcher passes it to the torchrun workers as SIGUSR1, they checkpoint at the next
step and stop, the launcher exits 75; `resume=auto` then continues to the last step."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 30


def _cmd(run_dir, cache, *extra):
    return [sys.executable, "-m", "moe_dist.cli", "train", "--config", "configs/test.yaml", "--nproc", "2",
            f"run.dir={run_dir}", f"data.cache_dir={cache}", f"train.steps={STEPS}", "run.progress=false",
            "run.print_every=1", "run.plots=false", "run.tensorboard=false", *extra]


def _steps_logged(run_dir) -> list[int]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    for line in open(path):
        try:
            out.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):  # a row being written
            pass
    return out


@pytest.mark.slow
def test_sigterm_to_the_launcher_checkpoints_and_resume_finishes(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    log = open(tmp_path / "first.log", "w+")
    proc = subprocess.Popen(_cmd(run_dir, cache), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        while not any(s >= 3 for s in _steps_logged(run_dir)):
            assert proc.poll() is None and time.time() < deadline, open(tmp_path / "first.log").read()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)  # the launcher only, as `docker stop` does
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    first = open(tmp_path / "first.log").read()
    assert rc == 75, first[-3000:]
    assert "[moe-dist] SIGTERM received: asking the training processes to checkpoint and stop" in first
    m = re.search(r"SIGUSR1 received: stopped after step (\d+)/%d, checkpoint \S+; exit code 75" % STEPS, first)
    assert m, first[-3000:]
    stopped = int(m.group(1))
    assert 3 <= stopped < STEPS and (run_dir / "checkpoints" / ("step_%06d" % stopped) / "COMPLETE").exists()

    second = subprocess.run(_cmd(run_dir, cache, "resume=auto"), cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert re.search(r"resumed from \S+step_%06d at step %d" % (stopped, stopped), second.stdout)
    assert _steps_logged(run_dir) == list(range(1, STEPS + 1))
