"""launch/slurm/train.sbatch on a real one-node Slurm cluster (tests/helpers/slurm.py: this machine, 127.0.0.1).

Needs root (munged, slurmctld and slurmd run as root; Debian's slurm-wlm and munge are
installed with apt-get when missing). The cluster lives in a temporary directory with its own
munge socket and ports, and its daemons are stopped at the end, also after a failure.

* a 2-task job of configs/test.yaml trains, logs metrics and saves its checkpoint;
* a 2-task job is preempted (SIGUSR1 to the batch shell, as ``#SBATCH --signal=B:USR1@...``
  does): the ranks checkpoint at the next step boundary and exit 75, the script requeues the
  job, and the requeued job continues from that checkpoint (resume=auto) to the last step;
* the same job shape with one torchrun per node (MOE_DIST_LAUNCH=torchrun);
* launch/slurm/prepare.sbatch as a 3-task array: the parts, combined by the last task to finish;
* a preset: launch/slurm/convert.sbatch upcycles as a job of its own, the preset's wrapper of
  train.sbatch trains after it (and refuses, in one line, to start without it);
* tasks that cannot report (the status directory out of their sight): one line says so.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from helpers.slurm import SlurmCluster, install_slurm
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


def test_a_preset_trains_after_its_conversion_job(cluster):
    """A preset's two steps: launch/slurm/convert.sbatch upcycles a tiny dense checkpoint as a job of its
    own, the preset's batch script (launch/slurm/presets/*.sbatch, a wrapper of train.sbatch) trains it
    after that job (``--dependency=afterok``) on 2 ranks; converting again is skipped."""
    pytest.importorskip("transformers")
    from helpers.hf_cases import add_sentencepiece, build_dense

    work = os.path.join(cluster.root, "preset")
    dense, run = os.path.join(work, "dense"), os.path.join(work, "run")
    os.makedirs(dense)
    corpus = os.path.join(REPO, "tests", "data", "python-docs")
    texts = [read_text(os.path.join(corpus, "tutorial", n)) for n in ("introduction.rst.txt", "controlflow.rst.txt")]
    add_sentencepiece(dense, texts, vocab_size=300)
    build_dense("llama", dense, vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    convert = os.path.join(REPO, "launch", "slurm", "convert.sbatch")
    args = ["upcycle", "--dense", dense, "--out", os.path.join(run, "init"), "model.moe.num_experts=4",
            "model.moe.top_k=2", "model.moe.layers=every_other"]
    conv_out, train_out = os.path.join(work, "convert-%j.out"), os.path.join(work, "train-%j.out")
    conv = cluster.submit(["-o", conv_out], convert, args, _job_env(), cwd=REPO)
    preset = os.path.join(REPO, "launch", "slurm", "presets", "phi3-mini-upcycle-4x2.sbatch")
    # the preset's 8-GPU node given as what this cluster has: 2 ranks, no GPU
    job = cluster.submit([f"--dependency=afterok:{conv}", "-n", "2", "--ntasks-per-node=2", "--cpus-per-task=1",
                          "--gpus-per-node=0", "-o", train_out], preset,
                         ["train.steps=4", "train.global_batch=4", "train.seq_len=32", f"data.corpus={corpus}",
                          f"data.cache_dir={work}/cache", "data.val_fraction=0.2", "eval.max_sequences=8", "eval.batch=4",
                          "parallel.ep=2",
                          *QUIET], _job_env(RUN=run), cwd=REPO)
    info = cluster.wait(conv, lambda i: i["JobState"] == "COMPLETED", 300, "the conversion COMPLETED", conv_out)
    assert "[convert] moe-dist upcycle exited with 0" in read_text(conv_out.replace("%j", conv))
    info = cluster.wait(job, lambda i: i["JobState"] == "COMPLETED", 300, "the training COMPLETED", train_out)
    out = read_text(train_out.replace("%j", job))
    assert info["ExitCode"] == "0:0", out[-3000:]
    _check_finished_run(run, 4, out, launcher="slurm")
    again = cluster.submit(["-o", conv_out], convert, args, _job_env(), cwd=REPO)
    cluster.wait(again, lambda i: i["JobState"] == "COMPLETED", 120, "the second conversion COMPLETED", conv_out)
    assert "upcycle done already, nothing to do" in read_text(conv_out.replace("%j", again))


def test_a_preset_without_its_converted_model_says_so(tmp_path):
    """A preset submitted before its conversion: one line naming the missing file and the step, exit 2."""
    preset = os.path.join(REPO, "launch", "slurm", "presets", "olmoe-1b-7b.sbatch")
    res = subprocess.run(["bash", preset, "train.steps=4"], env={"PATH": "/usr/bin:/bin", "RUN": str(tmp_path / "run"),
                                                                 "MOE_DIST_HOME": REPO},
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 2 and res.stdout == "", res
    assert res.stderr.startswith(f"olmoe-1b-7b: {tmp_path}/run/init/import.json is missing: convert the model first, a "
                                 "job of its own (launch/slurm/convert.sbatch") and len(res.stderr.splitlines()) == 1, res


def test_ranks_that_cannot_report_are_said_in_one_line(cluster):
    """Tasks that do not see the status directory (a container without it mounted: here their
    MOE_DIST_STATUS_DIR points elsewhere) cannot report: the failed job's output says, in one line, that
    its exit status is untranslated and no lost node can be named, instead of going on silently."""
    out_file = os.path.join(cluster.root, "unreported-%j.out")
    job = _submit(cluster, ["-n", "2", "-o", out_file],
                  ["configs/test.yaml", f"run.dir={cluster.root}/unreported", "parallel.ep=3", *QUIET],
                  _job_env(MOE_DIST_TASK_PREFIX=f"env MOE_DIST_STATUS_DIR={cluster.root}/not-there"))
    info = cluster.wait(job, lambda i: i["JobState"] == "FAILED", 300, "FAILED", out_file)
    out = read_text(out_file.replace("%j", job))
    assert "parallel.ep" in out and info["ExitCode"] != "0:0", out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("[launch] no rank reported how it ended in ")]
    assert len(lines) == 1 and "untranslated, no lost node named, no relaunch" in lines[0], out[-3000:]
