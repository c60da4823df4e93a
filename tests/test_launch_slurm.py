"""launch/slurm/train.sbatch on a real one-node Slurm cluster (moe_dist/testing/slurm.py: this machine, 127.0.0.1).

Needs root (munged, slurmctld and slurmd run as root; Debian's slurm-wlm and munge are
installed with apt-get when missing). The cluster lives in a temporary directory with its own
munge socket and ports, and its daemons are stopped at the end, also after a failure.

* a 2-task job of configs/test.yaml trains, logs metrics and saves its checkpoint;
* a 2-task job is preempted (SIGUSR1 to the batch shell, as ``#SBATCH --signal=B:USR1@...``
  does): the ranks checkpoint at the next step boundary and exit 75, the script requeues the
  job, and the requeued job continues from that checkpoint (resume=auto) to the last step;
* the same job shape with one torchrun per node (MOE_DIST_LAUNCH=torchrun);
* launch/slurm/prepare.sbatch as a 3-task array: the parts, combined by the last task to finish.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time

import pytest

from moe_dist.testing.slurm import SlurmCluster, install_slurm
from helpers.run_dir import complete_checkpoints, metrics_rows, read_text

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH = os.path.join(REPO, "launch", "slurm", "train.sbatch")
QUIET = ["run.progress=false", "run.plots=false", "run.tensorboard=false", "run.print_every=1"]


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("needs root: the test starts munged, slurmctld and slurmd itself")
    reason = install_slurm()
    if reason:
        pytest.skip(f"cannot set up Slurm: {reason}")
    root = tempfile.mkdtemp(prefix="moe-slurm-")
    os.chmod(root, 0o755)
    try:
        with SlurmCluster(root) as c:
            yield c
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _submit(cluster: SlurmCluster, sbatch_args: list[str], script_args: list[str], env: dict) -> str:
    return cluster.submit(sbatch_args, SBATCH, script_args, env, cwd=REPO)


def _job_env(**extra: str) -> dict:
    return {"PYTHON": sys.executable, **extra}


def _check_finished_run(run_dir: str, steps: int, out: str, launcher: str) -> None:
    assert f"done: {steps} steps" in out or f"step {steps}/{steps}" in out, out[-3000:]
    rows = metrics_rows(run_dir)
    assert rows and rows[-1]["step"] == steps, rows[-1:]
    assert all(r["loss"] == r["loss"] and 0 < r["loss"] < 20 for r in rows)
    assert steps in complete_checkpoints(run_dir)
    with open(os.path.join(run_dir, "run.json")) as f:
        info = json.load(f)
    assert info["world_size"] == 2 and info["launcher"] == launcher, info


def test_sbatch_two_tasks_trains_and_checkpoints(cluster):
    run_dir = os.path.join(cluster.root, "run-basic")
    out_file = os.path.join(cluster.root, "basic-%j.out")
    t0 = time.time()
    job = _submit(cluster, ["-n", "2", "-o", out_file], ["configs/test.yaml", f"run.dir={run_dir}", "train.steps=4", *QUIET],
                         _job_env())
    info = cluster.wait(job, lambda i: i["JobState"] == "COMPLETED", 300, "COMPLETED", out_file)
    out = read_text(out_file.replace("%j", job))
    assert info["ExitCode"] == "0:0", out[-3000:]
    _check_finished_run(run_dir, 4, out, launcher="slurm")
    assert "[launch] training exited with 0" in out
    print(f"\nslurm 2-task job: {time.time() - t0:.1f}s")


def test_sbatch_preempt_requeue_resume(cluster):
    steps = 40
    run_dir = os.path.join(cluster.root, "run-preempt")
    out_file = os.path.join(cluster.root, "preempt-%j.out")
    t0 = time.time()
    job = _submit(cluster, ["-n", "2", "-o", out_file], ["configs/test.yaml", f"run.dir={run_dir}", f"train.steps={steps}",
                                                       *QUIET], _job_env())
    deadline = time.time() + 240
    while len(metrics_rows(run_dir)) < 2:  # training is under way
        assert time.time() < deadline and cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), \
            read_text(out_file.replace("%j", job))[-3000:] if os.path.exists(out_file.replace("%j", job)) else cluster.logs()
        time.sleep(0.3)
    # what `#SBATCH --signal=B:USR1@300` does before the time limit: signal the batch shell only
    cluster.run("scancel", "--batch", "--signal=USR1", job)
    t_signal = time.time()
    # the script requeues the job; Slurm holds a requeued job back for cred_expire + 1 s (5 + 1 here)
    # so that its new batch credential is not taken for the revoked one of the first run
    info = cluster.wait(job, lambda i: i["Restarts"] == "1" or i["JobState"] == "COMPLETED", 240, "the requeue", out_file)
    assert info["Restarts"] == "1", f"not requeued: {info.get('JobState')}\n{read_text(out_file.replace('%j', job))[-3000:]}"
    t_requeue = time.time()
    info = cluster.wait(job, lambda i: i["JobState"] == "COMPLETED", 300, "COMPLETED after the requeue", out_file)
    out = read_text(out_file.replace("%j", job))
    assert info["ExitCode"] == "0:0", out[-3000:]

    m = re.search(r"SIGUSR1 received: stopped after step (\d+)/%d, checkpoint (\S+);" % steps, out)
    assert m, out[-3000:]
    stopped = int(m.group(1))
    assert 2 <= stopped < steps
    assert "exited with 75 after SIGUSR1" in out and f"requeueing job {job}" in out, out[-3000:] + cluster.logs()
    assert "(restart 1)" in out
    first_run, second_run = out.split("(restart 1)", 1)
    assert f"step {stopped}/{steps}" in first_run and f"step {stopped + 1}/{steps}" not in first_run
    # the requeued job resumed from the preemption checkpoint: its first step is the next one
    steps_run = [int(s) for s in re.findall(r"^step (\d+)/%d  loss" % steps, second_run, flags=re.M)]
    assert steps_run and steps_run[0] == stopped + 1, (stopped, steps_run[:3], second_run[:2000])
    assert steps_run[-1] == steps
    assert re.search(r"resumed from \S+step_%06d at step %d" % (stopped, stopped), second_run), second_run[:2000]
    assert {stopped, steps} <= set(complete_checkpoints(run_dir))
    assert [r["step"] for r in metrics_rows(run_dir)] == list(range(1, steps + 1))  # one row per step, none twice
    print(f"\nslurm preemption: signal after {t_signal - t0:.1f}s, stopped at step {stopped}/{steps}, requeued "
          f"{t_requeue - t_signal:.1f}s later, finished {time.time() - t0:.1f}s after submission")


def test_sbatch_one_torchrun_per_node(cluster):
    run_dir = os.path.join(cluster.root, "run-torchrun")
    out_file = os.path.join(cluster.root, "torchrun-%j.out")
    job = _submit(cluster, ["-N", "1", "--ntasks-per-node=1", "-c", "2", "-o", out_file],
                         ["configs/test.yaml", f"run.dir={run_dir}", "train.steps=3", *QUIET],
                         _job_env(MOE_DIST_LAUNCH="torchrun", NPROC_PER_NODE="2"))
    info = cluster.wait(job, lambda i: i["JobState"] == "COMPLETED", 300, "COMPLETED", out_file)
    out = read_text(out_file.replace("%j", job))
    assert info["ExitCode"] == "0:0", out[-3000:]
    _check_finished_run(run_dir, 3, out, launcher="torchrun")


def test_prepare_as_an_array_job(cluster):
    """launch/slurm/prepare.sbatch as a 3-task array: each task prepares its slice of the inputs, the last
    to finish combines the parts into one dataset holding every document."""
    from moe_dist.data import read_documents, train_tokenizer

    work = os.path.join(cluster.root, "prepare")
    os.makedirs(os.path.join(work, "in"))
    docs = [d.text for d in read_documents(os.path.join(REPO, "tests", "data", "python-docs"))]
    tok = os.path.join(work, "tokenizer.model")
    train_tokenizer(docs, 512).save(tok)
    paras = [p for d in docs for p in d.split("\n\n") if p.strip()][:400]
    for i in range(4):
        with open(os.path.join(work, "in", f"part{i}.jsonl"), "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": p}) + "\n" for p in paras[i * 100:(i + 1) * 100])
    out, out_file = os.path.join(work, "out"), os.path.join(work, "prepare-%A_%a.out")
    job = cluster.submit(["--array=0-2", "-o", out_file], os.path.join(REPO, "launch", "slurm", "prepare.sbatch"),
                         [out, "--tokenizer", tok, "--val-fraction", "0.1", os.path.join(work, "in", "*.jsonl")],
                         _job_env(), cwd=REPO)
    for task in range(3):
        info = cluster.wait(f"{job}_{task}", lambda i: i["JobState"] == "COMPLETED", 300, f"task {task} COMPLETED")
        assert info["ExitCode"] == "0:0", read_text(out_file.replace("%A", job).replace("%a", str(task)))[-3000:]
    with open(os.path.join(out, "manifest.json")) as f:
        m = json.load(f)
    assert m["parts"] == 3 and m["documents"] == 400 and m["source"]["files"] == 4
