"""Slurm across nodes: a real Slurm cluster on the nodes of a namespace cluster (tests/helpers/slurm.py
on tests/helpers/cluster/): slurmctld and munged on node0, one ``slurmd -N nodeI`` on each node.

* ``sbatch -N 2 --ntasks-per-node=2 launch/slurm/train.sbatch`` with ``parallel.ep=4`` (every MoE
  layer's experts span both nodes), one task per rank and one torchrun per node: preempted with
  ``scancel --batch --signal=USR1`` mid-run, the ranks on both nodes checkpoint, the script requeues
  the job, and the requeued job resumes on both nodes to the last step; the metrics hold every step
  once, the losses are bit for bit those of the same 4 ranks on one host uninterrupted, and those of 1
  process on the whole batch (1e-5) until a near tie of two experts' scores is decided the other way by
  rounding, if it is (tests/helpers/run_dir.py, ``assert_curve_matches``);
* node1 lost mid-run, unplugged (its link down: no reset reaches anyone; the heartbeat notices) or
  with every process killed, slurmd included: the ranks on node0 end with a line naming node1, and
  the batch script launches the job again on node0 alone inside its allocation (``#SBATCH
  --no-kill``), without waiting for Slurm to notice the node; ``parallel.ep=auto``, ``resume=auto``
  continue from the last complete checkpoint to the end: the relaunched steps bit for bit 2 ranks on
  one host resumed from that checkpoint, every step's metrics row once;
* the same with the tasks in a container whose interpreter the batch host does not have
  (``MOE_DIST_TASK_PREFIX``: a mount namespace per task): the ranks' reports are read without Python;
* node1's ranks killed (a crash on a node that stays up): the ranks on node0 name node1 lost, but node1
  answers the script's one-task step: the script says so and relaunches on both nodes;
* node1 killed, then restarted: Slurm does not give it back to the job; the script sees it idle,
  checkpoints and requeues, and the job goes on on both nodes.

The unplugged node runs with ``MOE_DIST_MULTINODE_FULL=1`` only (the killed node covers the relaunch
and the survivors' lines).

Opt-in like every multi-node test (``MOE_DIST_MULTINODE=1``, tests/conftest.py); needs root, ``ip netns``
(the cluster of tests/helpers/multinode_harness.py) and Slurm (installed from Debian's packages when missing);
skipped with the reason elsewhere.
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

from helpers.slurm import SlurmCluster
from helpers.run_dir import assert_curve_matches, complete_checkpoints, metrics_rows, read_text
from helpers.slurm_container import container_stand_in
from helpers.multinode_harness import ROOT, _env, cluster, slurm_on  # noqa: F401 (fixture)

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

SBATCH = os.path.join(ROOT, "launch", "slurm", "train.sbatch")
STEPS = 16
# every run of this file: the same curve (so one reference), a checkpoint every 4 steps
TRAIN = ["run.progress=false", "run.plots=false", "run.tensorboard=false", "run.print_every=1",
         "eval.max_sequences=8", f"train.steps={STEPS}", "ckpt.every=4", "ckpt.verify=false"]
SLURMD_TIMEOUT = 30  # s without an answer before slurmctld sets a node DOWN (Slurm's default: 300)
KILL_WAIT = 10  # s between SIGTERM and SIGKILL when Slurm ends a job (Slurm's default: 30)
JOB_TIMEOUT = 420  # one job, start to end, on a busy 2-core machine (~60-120 s alone)
# the cases that add little to the others and minutes to the suite run with MOE_DIST_MULTINODE_FULL=1
# (measured in benchmarks/results/multinode.md, "Slurm across nodes"): an unplugged node (the same relaunch as a killed one, after a
# longer silence)
FULL = pytest.mark.skipif(os.environ.get("MOE_DIST_MULTINODE_FULL", "0") in ("", "0"),
                          reason="set MOE_DIST_MULTINODE_FULL=1 for the unplugged node under Slurm")


@pytest.fixture(scope="module")
def slurm(cluster):  # noqa: F811 (the harness's fixture)
    with slurm_on(cluster, "moe-slurm-nodes-", slurmd_timeout=SLURMD_TIMEOUT, kill_wait=KILL_WAIT) as s:
        yield s


@pytest.fixture(autouse=True)
def _plugged_in(request):
    """Before every test the bridge allowed through iptables (a dockerd started meanwhile sets the
    FORWARD policy to DROP) and every node idle; after it, every link plugged in again and no job left."""
    s = request.getfixturevalue("slurm") if "slurm" in request.fixturenames else None
    if s is not None:
        s.cluster.allow_forwarding()
        s.wait_idle(len(s.nodes), 120)
    yield
    if s is not None:
        for nd in s.cluster.nodes:
            s.cluster.set_link(nd, True)
        s.cancel_all()  # a job that a failed test left behind


def _one_host(root: str, name: str, *args: str, first: int = 1) -> list[dict]:
    """The metrics rows of one uninterrupted run on this host (the root namespace), from step ``first``
    (a resumed run) to the end."""
    run_dir = os.path.join(root, name)
    res = subprocess.run([sys.executable, "-m", "moe_dist.cli", "train", "--config", "configs/test.yaml", *args,
                          f"run.dir={run_dir}", f"data.cache_dir={root}/cache", *TRAIN],
                         cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = metrics_rows(run_dir)
    rows = [r for r in rows if r["step"] >= first]
    assert [r["step"] for r in rows] == list(range(first, STEPS + 1))
    assert first > 1 or rows[-1]["loss"] < rows[0]["loss"]  # (a few steps late in the run need not go down)
    return rows


@pytest.fixture(scope="module")
def reference(slurm):
    """1 process on the whole batch (``parallel.ep=1``), and the jobs' 4 ranks (``parallel.ep=4``)
    uninterrupted on one host: their metrics rows."""
    return {"one": _one_host(slurm.root, "reference", "parallel.ep=1"),
            "four": _one_host(slurm.root, "four-ranks", "--nproc", "4", "parallel.ep=4")}


class Job:
    """One ``sbatch -N 2 --ntasks-per-node=2 launch/slurm/train.sbatch configs/test.yaml parallel.ep=4 ...``."""

    def __init__(self, s: SlurmCluster, name: str, *overrides: str, **env: str):
        self.s = s
        self.run_dir = os.path.join(s.root, name)
        self.out_file = os.path.join(s.root, f"{name}-%j.out")
        self.t0 = time.monotonic()
        self.id = s.submit(["-N", "2", "--ntasks-per-node=2", "-o", self.out_file], SBATCH,
                           ["configs/test.yaml", f"run.dir={self.run_dir}", f"data.cache_dir={s.root}/cache",
                            "parallel.ep=4", *TRAIN, *overrides], {**_env(), **env}, cwd=ROOT)
        self.out_file = self.out_file.replace("%j", self.id)

    def output(self) -> str:
        return read_text(self.out_file) if os.path.exists(self.out_file) else ""

    def info(self) -> dict:
        return self.s.job(self.id)

    def wait(self, done, what: str, timeout: float = JOB_TIMEOUT) -> dict:
        return self.s.wait(self.id, done, timeout, what, self.out_file)

    def wait_for_step(self, step: int, checkpoint: bool = False) -> None:
        """Until metrics.jsonl has ``step`` rows (and, with ``checkpoint``, a complete checkpoint exists)."""
        deadline = time.monotonic() + JOB_TIMEOUT
        while len(metrics_rows(self.run_dir)) < step or (checkpoint and not complete_checkpoints(self.run_dir)):
            info = self.info()
            assert time.monotonic() < deadline and info["JobState"] in ("PENDING", "CONFIGURING", "RUNNING"), \
                f"job {self.id} {info['JobState']} before step {step}\n{self.output()[-3000:]}\n{self.s.logs()}"
            time.sleep(0.3)

    def check_finished(self, reference: dict, launcher: str) -> str:
        """The job COMPLETED on both nodes: every step's metrics row once; the losses bit for bit those of
        its 4 ranks on one host uninterrupted (a resume across nodes changes nothing), and those of 1 process
        (to 1e-5 until rounding decides a near tie of two experts the other way, if it does)."""
        info = self.wait(lambda i: i["JobState"] == "COMPLETED", "COMPLETED")
        out = self.output()
        assert info["ExitCode"] == "0:0" and info["NodeList"] == "node[0-1]", (info, out[-3000:])
        rows = metrics_rows(self.run_dir)
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]  # none missing or twice
        assert [r["loss"] for r in rows] == [r["loss"] for r in reference["four"]]
        assert_curve_matches(rows, reference["one"])
        with open(os.path.join(self.run_dir, "run.json")) as f:
            run = json.load(f)
        assert (run["world_size"], run["ep"], run["launcher"]) == (4, 4, launcher), run
        assert STEPS in complete_checkpoints(self.run_dir)
        return out


def _preempt_requeue_resume(s: SlurmCluster, reference, launcher: str, **env) -> None:
    before = [s.cluster.link_bytes(nd) for nd in s.cluster.nodes]
    job = Job(s, f"preempt-{launcher}", **env)
    job.wait_for_step(2)
    # what `#SBATCH --signal=B:USR1@300` does before the time limit: signal the batch shell only
    s.run("scancel", "--batch", "--signal=USR1", job.id)
    t_signal = time.monotonic()
    info = job.wait(lambda i: i["Restarts"] == "1" or i["JobState"] == "COMPLETED", "the requeue")
    assert info["Restarts"] == "1", f"not requeued: {info['JobState']}\n{job.output()[-3000:]}"
    t_requeue = time.monotonic()
    out = job.check_finished(reference, launcher)
    moved = [s.cluster.link_bytes(nd)[0] - b[0] for nd, b in zip(s.cluster.nodes, before)]

    first, second = out.split("(restart 1)", 1)
    assert f"on 2 node(s): node[0-1]; launch {launcher if launcher == 'torchrun' else 'srun'}; rendezvous node0:" \
        in first, first[:2000]
    m = re.search(r"SIGUSR1 received: stopped after step (\d+)/%d" % STEPS, first)
    assert m, first[-3000:]
    stopped = int(m.group(1))
    assert 2 <= stopped < STEPS and "exited with 75 after SIGUSR1" in first and f"requeueing job {job.id}" in first
    assert re.search(r"resumed from \S+step_%06d at step %d" % (stopped, stopped), second), second[:3000]
    steps_run = [int(k) for k in re.findall(r"^step (\d+)/%d  loss" % STEPS, second, flags=re.M)]
    assert steps_run[0] == stopped + 1 and steps_run[-1] == STEPS, steps_run
    assert stopped in complete_checkpoints(job.run_dir)
    # both runs trained across the nodes: each node received megabytes (FSDP's gathers, the all-to-alls)
    assert min(moved) > 2_000_000, moved
    print(f"\nslurm 2 nodes x 2 ({launcher}): preempted {t_signal - job.t0:.1f} s after submission at step "
          f"{stopped}/{STEPS}, requeued {t_requeue - t_signal:.1f} s later, finished "
          f"{time.monotonic() - job.t0:.1f} s after submission; received {moved[0]:,} / {moved[1]:,} bytes")


def test_one_task_per_rank_on_two_nodes_preempted_requeued_matches_one_process(slurm, reference):
    _preempt_requeue_resume(slurm, reference, "slurm")


def test_one_torchrun_per_node_preempted_requeued_matches_one_process(slurm, reference):
    _preempt_requeue_resume(slurm, reference, "torchrun", MOE_DIST_LAUNCH="torchrun")


def _seen(job: Job, text: str, t0: float, after: str = "", timeout: float = JOB_TIMEOUT) -> float:
    """Seconds from ``t0`` until the job's output has ``text`` (after ``after``, when given)."""
    deadline = time.monotonic() + timeout
    while True:
        out = job.output()
        part = out if not after else out.split(after, 1)[1] if after in out else ""
        if text in part:
            return time.monotonic() - t0
        info = job.info()
        # (COMPLETING, REQUEUED: passing states of a job that requeues itself)
        assert time.monotonic() < deadline and info["JobState"] in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING",
                                                                    "REQUEUED"), \
            f"job {job.id} {info['JobState']} before {text!r}\n{out[-3000:]}\n{job.s.logs()}\n--- the launcher's lines\n" + \
            "\n".join(line for line in out.splitlines() if line.startswith("[launch]"))
        time.sleep(0.2)


def _reboot(s: SlurmCluster, node: str) -> None:
    """The node's processes gone, its link up, its slurmd registered (Slurm returns it to service)."""
    s.cluster.kill_node(node)
    s.cluster.set_link(node, True)
    s.start_slurmd(node)


def _container(s: SlurmCluster) -> dict:
    """The tasks in a container whose interpreter the batch host does not have (tests/helpers/slurm_container.py)."""
    return container_stand_in(s.root)


@pytest.mark.parametrize("how", [pytest.param("unplugged", marks=FULL), "killed", "killed-container"])
def test_a_lost_node_the_job_goes_on_with_the_nodes_left(slurm, reference, tmp_path, how):
    """node1 lost after step 6 (every process of it killed, slurmd included, or its link cut: then the
    heartbeat notices): the ranks on node0 end with a line naming node1, the batch script launches the
    job again on node0 alone inside the same allocation (#SBATCH --no-kill), which resumes from the last
    complete checkpoint (parallel.ep=auto: 2 on both layouts) and finishes, long before Slurm would
    notice the node (SlurmdTimeout) and with no requeue. The steps after the relaunch equal a 2-rank run
    on one host resumed from the same checkpoint, bit for bit; the whole curve is the 1-process one (up
    to a routing near tie); metrics.jsonl has every step once. ``killed-container``: the same with the
    tasks in a container whose interpreter the batch host does not have (the reports read without it)."""
    s = slurm
    env = _container(s) if how == "killed-container" else {}
    job = Job(s, f"lost-{how}", "parallel.ep=auto", "parallel.heartbeat_timeout_s=10", "parallel.timeout_s=300",
              **env)
    job.wait_for_step(6, checkpoint=True)
    if how == "unplugged":
        s.cluster.set_link("node1", False)
    else:
        s.cluster.kill_node("node1")
    t0 = time.monotonic()
    try:
        noticed = _seen(job, "moe-dist train: rank 0:", t0)
        relaunched = _seen(job, "[launch] relaunch 1/3 on 1 node(s): node0", t0)
        reloaded = _seen(job, "resumed from", t0, after="[launch] relaunch 1/3")
        resumed = int(re.search(r"resumed from \S+step_(\d{6})", job.output().split("[launch] relaunch 1/3")[1]).group(1))
        first_step = _seen(job, f"step {resumed + 1}/{STEPS}", t0, after="[launch] relaunch 1/3")
        info = job.wait(lambda i: i["JobState"] == "COMPLETED", "COMPLETED")
        finished = time.monotonic() - t0
    finally:
        _reboot(s, "node1")
    out = job.output()
    assert info["ExitCode"] == "0:0" and info["Restarts"] == "0", (info, out[-3000:])
    assert "no rank reported" not in out and "answers: not lost" not in out, out[-3000:]
    before, after = out.split("[launch] relaunch 1/3", 1)
    assert "[launch] lost node(s): node1; 1 node(s) left" in before, before[-3000:]
    lines = [line for line in before.splitlines() if line.startswith("moe-dist train: rank")]
    assert lines and all("node node1 (ranks 2, 3)" in line for line in lines), before[-3000:]
    m = re.search(r"resumed from \S+step_(\d{6}) at step \d+ \(saved by 4 rank\(s\), ep=2.*now 2 rank\(s\), ep=2\)",
                  after)
    assert m and int(m.group(1)) == resumed, after[:3000]
    steps_run = [int(k) for k in re.findall(r"^step (\d+)/%d  loss" % STEPS, after, flags=re.M)]
    assert steps_run[0] == resumed + 1 and steps_run[-1] == STEPS, steps_run
    rows = metrics_rows(job.run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]  # none missing or twice
    assert_curve_matches(rows, reference["one"])
    # the same checkpoint resumed by 2 ranks on one host, uninterrupted
    ref = tmp_path / "ref"
    os.makedirs(ref / "checkpoints")
    name = f"step_{resumed:06d}"
    shutil.copytree(os.path.join(job.run_dir, "checkpoints", name), ref / "checkpoints" / name)
    shutil.copy(os.path.join(job.run_dir, "config.yaml"), ref / "config.yaml")
    again = _one_host(str(tmp_path), "ref", "--nproc", "2", "parallel.ep=auto", "resume=auto", first=resumed + 1)
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in rows[resumed:]] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in again]
    print(f"\nslurm, node1 {how} after step 6: node0's ranks ended {noticed:.1f} s later, the batch script relaunched "
          f"on node0 at {relaunched:.1f} s, the checkpoint of step {resumed} was loaded at {reloaded:.1f} s, step "
          f"{resumed + 1} made at {first_step:.1f} s, the job finished at {finished:.1f} s (no requeue)")


def _ranks_on(s: SlurmCluster, node: str, run_dir: str) -> list[int]:
    """The pids of the training processes of ``run_dir`` on ``node``."""
    pids = []
    for pid in s.cluster.pids(node):
        try:
            cmd = read_text(f"/proc/{pid}/cmdline").split("\0")
        except OSError:
            continue
        if "moe_dist.cli" in cmd and f"run.dir={run_dir}" in cmd:
            pids.append(pid)
    return pids


def test_a_node_whose_ranks_crashed_is_not_lost(slurm, reference):
    """node1's ranks killed (a crash, the out-of-memory killer) while node1 stays up: node0's ranks name
    node1 lost, but node1 answers the batch script's one-task step, so the script says that its ranks
    ended (and why, as far as the node knows: tests/test_launch_oom.py has the kernel's out-of-memory kill)
    and launches the job again on both nodes, not on node0 alone; the job resumes from the last
    checkpoint on 4 ranks (``parallel.ep=4`` as given) and ends with the uninterrupted curve, bit for bit,
    every step's metrics row once."""
    s = slurm
    job = Job(s, "crashed", "parallel.timeout_s=300", "parallel.heartbeat_timeout_s=10")
    job.wait_for_step(5, checkpoint=True)
    pids = _ranks_on(s, "node1", job.run_dir)
    assert len(pids) == 2, pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    relaunched = _seen(job, "[launch] relaunch 1/3 on 2 node(s): node0,node1", t0)
    info = job.wait(lambda i: i["JobState"] in ("FAILED", "COMPLETED"), "the end")
    out = job.output()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), (info, out[-3000:])
    before, after = out.split("[launch] relaunch 1/3 on 2 node(s): node0,node1", 1)
    lines = [line for line in before.splitlines() if line.startswith("moe-dist train: rank")]
    assert lines and all("node node1 (ranks 2, 3)" in line for line in lines), before[-3000:]
    assert re.search(r"^\[launch\] node node1 answers: not lost, its ranks ended: ", before, flags=re.M), before[-3000:]
    assert "[launch] lost node(s)" not in out, out[-3000:]
    m = re.search(r"resumed from \S+step_(\d{6}) at step \d+", after)
    assert m and int(m.group(1)) >= 4, after[:3000]
    rows = metrics_rows(job.run_dir)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]
    assert [r["loss"] for r in rows] == [r["loss"] for r in reference["four"]]
    print(f"\nslurm, node1's ranks killed, node1 up: relaunched on both nodes {relaunched:.1f} s later, resumed from "
          f"step {int(m.group(1))}")


def test_a_lost_node_that_comes_back_grows_the_job_by_a_requeue(slurm):
    """node1 killed (slurmd included) after step 6: Slurm removes it from the job ("Removing failed node")
    and the job goes on on node0 alone; node1 restarted, Slurm returns it to service but not to the job
    (a step on it is refused: measured, benchmarks/results/multinode.md). The batch script's watch (MOE_DIST_REGROW_S=5)
    sees it idle, the run checkpoints, the job is requeued and starts again on both nodes, which finish it
    from that checkpoint; every step's metrics row once."""
    s = slurm
    steps = 400  # long enough that node0 alone is still training when node1 is back
    job = Job(s, "regrow", "parallel.ep=auto", "parallel.heartbeat_timeout_s=10", "parallel.timeout_s=300",
              f"train.steps={steps}", "ckpt.every=50", MOE_DIST_REGROW_S="5")
    job.wait_for_step(6, checkpoint=True)
    s.cluster.kill_node("node1")
    t0 = time.monotonic()
    try:
        alone = _seen(job, "[launch] relaunch 1/3 on 1 node(s): node0", t0)
    finally:
        _reboot(s, "node1")
    t_back = time.monotonic() - t0
    seen = _seen(job, "[launch] node node1 is back in service, outside this job's allocation", t0)
    grown = _seen(job, "(restart 1) on 2 node(s): node[0-1]", t0)
    info = job.wait(lambda i: i["JobState"] in ("FAILED", "COMPLETED"), "the end")
    out = job.output()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), (info, out[-3000:])
    first, second = out.split("(restart 1)", 1)
    alone_part = first.split("[launch] relaunch 1/3 on 1 node(s): node0", 1)[1]
    assert f"requeueing job {job.id}" in alone_part, alone_part[-3000:]
    # the run on node0 alone checkpointed where it was (or, still starting, stopped): the requeued job goes on
    # from its last checkpoint, on 4 ranks
    m = re.search(r"resumed from \S+step_(\d{6}) at step \d+ \(saved by (\d) rank", second)
    assert m and int(m.group(1)) >= 4 and "parallel: 4 process(es)" in second, second[:3000]
    stopped = int(m.group(1))
    resumed = _seen(job, "step %d/%d" % (stopped + 1, steps), t0, after="(restart 1)")
    rows = metrics_rows(job.run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), [r["step"] for r in rows]  # none missing or twice
    print(f"\nslurm, node1 killed after step 6 and restarted {t_back:.1f} s later: node0 alone from {alone:.1f} s; "
          f"node1 seen idle at {seen:.1f} s, the requeued job started on both nodes at {grown:.1f} s, resumed from step "
          f"{stopped} and made step {stopped + 1} at {resumed:.1f} s")
