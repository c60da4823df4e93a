"""docs/cluster-quickstart.md walked for real: its bash blocks, run in order in bash on the head node of the
project's test Slurm cluster over 2 network-namespace nodes (tests/test_multinode_slurm.py's cluster), from a
dense Hugging Face checkpoint to an exported MoE one.

What stands in for what:

* the cluster: 2 namespace nodes (tests/helpers/cluster/) under a real Slurm (tests/helpers/slurm.py:
  slurmctld on node0, a slurmd on each node; no GPUs, 2 CPUs a node); the commands run as the page writes
  them, with real ``srun`` and ``sbatch``;
* the 7B checkpoint, the corpus and ``/shared``: a tiny random dense Llama (tests/helpers/quickstart.py), the
  test corpus and a temporary directory: the page's paths replaced in its text, and its cluster sizes
  (``-N 8``/``-N 4`` x 8 tasks, 8 GPUs and 8 CPUs a task) by ``-N 2``/``-N 1`` x 2 tasks of 1 CPU;
* the pyxis container: the test Slurm has no pyxis, so two bash functions replace its options by the
  container stand-in of tests/helpers/slurm_container.py (the project's interpreter and ``moe-dist``
  exist only in a mount namespace of each task's own): ``srun``'s ``--container-image/-workdir/-mounts``
  (the page's ``$CT``) become that wrapper before the task's command (the tasks run in the submit directory,
  not in the image's /opt/moe_dist, and /shared is the same path inside and out); for ``sbatch``,
  ``MOE_DIST_CONTAINER_IMAGE``/``MOE_DIST_CONTAINER_MOUNTS`` become ``MOE_DIST_TASK_PREFIX`` (the wrapper)
  and ``PYTHON`` (its interpreter), the batch script's other container path (launch/README.md). The bash
  running the page has no ``moe-dist`` and no project interpreter on its ``PATH``;
* ``enroot import`` (step 0) and ``tensorboard`` (step 5): functions; the latter checks that the run
  writes TensorBoard events where the page points it;
* the job's log ``moe-dist-JOBID.out``: the sbatch function adds ``-o`` (a file of the temporary
  directory, not the checkout) and the page's ``grep`` reads that file;
* sizes and speed: the moe-dist commands get a few overrides after the page's (a 32-token sequence, 60
  steps and a checkpoint every 10, a 10 s heartbeat, no plots or progress bar).

Checked: the upcycle writes the model; ``plan`` prints ``recommended:``; the dry run says ``verdict: fits``;
the job starts on both nodes, node1 is killed (every process, slurmd included) after a complete checkpoint,
the batch script prints ``[launch] lost node(s): node1; 1 node(s) left`` and relaunches on node0, which
resumes and completes every step (metrics rows once each); the page's ``grep`` shows that line; the
resume step (``sbatch -N 1``) continues from the last checkpoint to 70 steps on one node; the export
writes a Mixtral checkpoint that transformers loads and runs.

Opt-in like every multi-node test (``MOE_DIST_MULTINODE=1``); needs root, ``ip netns`` and Slurm.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from helpers.slurm import SlurmCluster
from helpers.multinode_harness import ROOT, _env, cluster, slurm_on  # noqa: F401 (fixture)
from helpers.quickstart import page_blocks, page_paths, substitute, tiny_dense
from helpers.run_dir import complete_checkpoints, metrics_rows, read_text
from helpers.slurm_container import container_stand_in

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

STEPS, EVERY, MORE = 60, 10, 70  # the job's steps, its checkpoints, the resume's steps
JOB_TIMEOUT = 420
# the page's cluster sizes -> this cluster's
SIZES = {"-N 8 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=8": "-N 2 --ntasks-per-node=2 --cpus-per-task=1",
         "-N 4 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=8": "-N 1 --ntasks-per-node=2 --cpus-per-task=1"}
TOOLS = r"""
srun() {  # pyxis's --container-* options (the page's $CT) -> the stand-in container before the task's command
  local opts=() seen=""
  while [ $# -gt 0 ] && [ "$1" != moe-dist ]; do
    case $1 in --container-image=*) seen=1 ;; --container-*) ;; *) opts+=("$1") ;; esac
    shift
  done
  [ -n "$seen" ] || { echo "srun without --container-image" >&2; return 9; }
  command srun "${opts[@]}" "$STAND_IN" "$@" $TASK_EXTRA
}
sbatch() {  # pyxis's image and mounts -> MOE_DIST_TASK_PREFIX (the stand-in) and PYTHON (its interpreter)
  [ -n "${MOE_DIST_CONTAINER_IMAGE:-}" ] || { echo "sbatch without MOE_DIST_CONTAINER_IMAGE" >&2; return 9; }
  MOE_DIST_CONTAINER_IMAGE="" MOE_DIST_CONTAINER_MOUNTS="" MOE_DIST_TASK_PREFIX=$STAND_IN PYTHON=$STAND_IN_PY \
    command sbatch --parsable -o "$JOB_OUT" "$@" $JOB_EXTRA
}
enroot() { echo "enroot $*"; }
tensorboard() { [ -n "$(find "$2" -name 'events.out.tfevents*')" ] && echo "tensorboard: events in $2"; }
"""


@pytest.fixture(scope="module")
def slurm(cluster):  # noqa: F811 (the harness's fixture)
    with slurm_on(cluster, "moe-quickstart-", slurmd_timeout=30, kill_wait=10) as s:
        yield s


class Page:
    """The page's blocks, its paths and sizes replaced, each run in bash on the head node after its first
    block (the variables) and the stand-in tools."""

    def __init__(self, s: SlurmCluster, shared: str):
        self.s, self.shared = s, shared
        self.paths = {**page_paths(tiny_dense(os.path.join(shared, "dense")), shared), **SIZES}
        for old in self.paths:
            assert old in "\n".join(page_blocks()), f"the page no longer says {old!r}"
        blocks = [substitute(b, self.paths) for b in page_blocks()]
        self.head, self.blocks = blocks[0], blocks[1:]
        stand_in = container_stand_in(s.root)
        bin_dir = os.path.dirname(sys.executable)
        self.env = {**_env(), **s.env, "STAND_IN": stand_in["MOE_DIST_TASK_PREFIX"], "STAND_IN_PY": stand_in["PYTHON"],
                    "PATH": ":".join(p for p in os.environ["PATH"].split(":") if p and os.path.realpath(p) !=
                                     os.path.realpath(bin_dir))}
        self.env.pop("PYTHON")

    def block(self, *words: str) -> str:
        found = [b for b in self.blocks if all(w in b for w in words)]
        assert len(found) == 1, (words, found)
        return found[0]

    def run(self, block: str, timeout: float = JOB_TIMEOUT, **env: str) -> str:
        script = TOOLS + self.head + block
        res = subprocess.run(self.s.command(self.s.head, ["bash", "-euo", "pipefail", "-c", script]),
                             env={**self.env, "TASK_EXTRA": "", "JOB_EXTRA": "", "JOB_OUT": "", **env}, cwd=ROOT,
                             capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, f"{block}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
        return res.stdout + res.stderr


def _job_id(out: str) -> str:
    """The job id ``sbatch --parsable`` printed last."""
    return out.strip().splitlines()[-1].split(";")[0]


def _log(path: str) -> str:
    return read_text(path) if os.path.exists(path) else ""


def _wait(s: SlurmCluster, job: str, out_file: str, what: str, done, timeout: float = JOB_TIMEOUT) -> None:
    """Until ``done()``, while the job is still running; its output and the daemons' logs otherwise."""
    deadline = time.monotonic() + timeout
    while not done():
        info = s.job(job)
        if time.monotonic() > deadline or info["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            raise AssertionError(f"job {job} {info['JobState']} before {what}\n{_log(out_file)[-4000:]}\n{s.logs()}")
        time.sleep(0.3)


def test_the_quickstart_page_on_two_nodes_loses_one_resumes_on_one_exports(slurm):
    s = slurm
    s.cluster.allow_forwarding()  # (a dockerd started meanwhile sets the FORWARD policy to DROP)
    s.wait_idle(len(s.nodes), 120)
    try:
        _walk(s)
    finally:
        s.cluster.set_link("node1", True)
        s.cancel_all()  # a job that a failure left behind


def _walk(s: SlurmCluster) -> None:
    t_start = time.monotonic()
    page = Page(s, os.path.join(s.root, "shared"))
    run_dir = os.path.join(page.shared, "runs", "llama7b-8x2")
    job_extra = " ".join(["run.progress=false", "run.plots=false", "run.print_every=1", "eval.max_sequences=64",
                          "data.val_fraction=0.2", f"data.cache_dir={s.root}/cache", "parallel.heartbeat_timeout_s=10",
                          "parallel.timeout_s=300"])

    page.run(page.block("enroot import"))
    up = page.run(page.block("moe-dist upcycle"), TASK_EXTRA=f"train.seq_len=32 train.steps={STEPS} ckpt.every={EVERY}")
    assert os.path.isfile(os.path.join(page.shared, "up", "llama7b-8x2", "model.safetensors")), up
    out = page.run(page.block("moe-dist plan", "--gpu-mem-gib 80\n"))
    assert "recommended:" in out, out
    out = page.run(page.block("moe-dist plan", "--dry-run"))
    verdict = next((line for line in out.splitlines() if line.startswith("verdict: ")), "")
    assert verdict.startswith("verdict: fits"), out

    # 4. the job on 2 nodes; 6. node1 lost after a complete checkpoint
    out1 = os.path.join(s.root, "first-%j.out")
    job = _job_id(page.run(page.block("sbatch -N 2"), JOB_OUT=out1, JOB_EXTRA=job_extra))
    out1 = out1.replace("%j", job)
    t_job = time.monotonic()
    _wait(s, job, out1, "a checkpoint", lambda: complete_checkpoints(run_dir))
    assert len(metrics_rows(run_dir)) < STEPS, "the job ended before node1 could be lost"
    assert s.job(job)["NodeList"] == "node[0-1]"
    s.cluster.kill_node("node1")
    t_kill = time.monotonic()
    try:
        _wait(s, job, out1, "the lost node's line", lambda: "[launch] lost node(s)" in _log(out1))
        t_lost = time.monotonic()
        info = s.wait(job, lambda i: i["JobState"] == "COMPLETED", JOB_TIMEOUT, "COMPLETED", out1)
    finally:
        s.cluster.kill_node("node1")
        s.cluster.set_link("node1", True)
        s.start_slurmd("node1")
    log = read_text(out1)
    assert info["ExitCode"] == "0:0" and info["Restarts"] == "0", (info, log[-3000:])
    assert "[launch] lost node(s): node1; 1 node(s) left" in log, log[-3000:]
    assert "[launch] relaunch 1/3 on 1 node(s): node0" in log, log[-3000:]
    after = log.split("[launch] relaunch 1/3 on 1 node(s): node0", 1)[1]
    assert re.search(r"resumed from \S+step_\d{6}", after) and f"step {STEPS}/{STEPS}" in after, after[-3000:]
    assert [r["step"] for r in metrics_rows(run_dir)] == list(range(1, STEPS + 1))
    out = page.run(page.block("tensorboard"))
    assert "tensorboard: events in" in out, out
    grep = page.run(substitute(page.block("grep"), {"moe-dist-JOBID.out": out1}))
    assert "[launch] lost node(s): node1; 1 node(s) left" in grep and "[launch] relaunch 1/3" in grep, grep

    # 7. resume on 1 node, to more steps
    out2 = os.path.join(s.root, "resume-%j.out")
    job2 = _job_id(page.run(page.block("sbatch -N 1"), JOB_OUT=out2, JOB_EXTRA=f"{job_extra} train.steps={MORE}"))
    out2 = out2.replace("%j", job2)
    info = s.wait(job2, lambda i: i["JobState"] == "COMPLETED", JOB_TIMEOUT, "COMPLETED", out2)
    log2 = read_text(out2)
    assert info["ExitCode"] == "0:0" and "on 1 node(s)" in log2, (info, log2[-3000:])
    assert re.search(r"resumed from \S+step_%06d" % STEPS, log2), log2[-3000:]
    assert [r["step"] for r in metrics_rows(run_dir)] == list(range(1, MORE + 1))

    # 8. export, loaded by transformers
    page.run(page.block("moe-dist export"))
    hf = os.path.join(page.shared, "hf", "llama7b-8x2")
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf)
    assert type(model).__name__ == "MixtralForCausalLM" and model.config.num_local_experts == 8
    with torch.no_grad():
        logits = model(torch.arange(16).unsqueeze(0)).logits
    assert logits.shape == (1, 16, 512) and torch.isfinite(logits).all()
    print(f"\ndry run: {verdict}\nstep 6's grep:\n{grep.strip()}")
    print(f"quickstart on 2 nodes: node1 killed {t_kill - t_job:.1f} s after submission, the lost node named "
          f"{t_lost - t_kill:.1f} s later; the whole page walked in {time.monotonic() - t_start:.1f} s")
