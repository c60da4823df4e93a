"""Failure handling of `moe-dist train --nproc 2` with the real launcher and real processes:
signals, exit codes, a rank killed or stopped, the run-directory lock, non-finite steps, a full
disk and a damaged checkpoint (issue 18; the launcher's output, issue 19)."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def command(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return [sys.executable, "-m", "moe_dist.cli", "train", "--config", "configs/test.yaml", "--nproc", "2",
            "run.progress=false", "run.plots=false", "run.tensorboard=false", *args], env


class Job:
    """`moe-dist train --nproc 2` in a session of its own, output in files."""

    def __init__(self, tmp, *args, name="job"):
        self.out, self.err = tmp / f"{name}.out", tmp / f"{name}.err"
        cmd, env = command(f"data.cache_dir={tmp.parent / 'cache'}", *args)
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)

    def wait_for(self, text, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.out.read_text():
                return
            assert self.proc.poll() is None, f"ended ({self.proc.returncode}) before {text!r}:\n{self.output()}"
            time.sleep(0.1)
        raise AssertionError(f"no {text!r} in {timeout} s:\n{self.output()}")

    def wait(self, timeout=120):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise

    def ranks(self):
        """pids of the launcher's children (the ranks)."""
        return sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == self.proc.pid)

    def output(self):
        return self.out.read_text() + "\n--- stderr ---\n" + self.err.read_text()


def _ppid(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def alive_with(marker):
    """pids of live processes whose command line names ``marker`` (a run directory of this test)."""
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{p}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(p))
    return found


def no_orphans(marker, timeout=10):
    deadline = time.monotonic() + timeout
    while alive_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive_with(marker), f"processes left running: {alive_with(marker)}"


LONG = ("train.steps=400", "run.print_every=1")
OUTLASTING_STEPS = 1_000_000  # a run of this many steps is live for the whole test, at any machine's speed


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_to_the_launcher_checkpoints_and_exits_75(tmp_path, sig):
    run = tmp_path / "run"
    job = Job(tmp_path, f"run.dir={run}", *LONG)
    job.wait_for("step 2/400")
    os.kill(job.proc.pid, sig)  # the launcher alone, as `kill <pid>` does
    assert job.wait() == 75, job.output()
    out = job.output()
    assert f"{sig.name} received: stopped after step" in out and "exit code 75" in out, out
    assert out.count(" received: stopped after step") == 1, out
    step = int(out.split("stopped after step ")[1].split("/")[0])
    assert os.path.exists(run / "checkpoints" / f"step_{step:06d}" / "COMPLETE")
    assert "Traceback" not in out
    no_orphans(str(run))


def test_a_stop_signal_while_the_ranks_start_is_not_lost(tmp_path):
    run = tmp_path / "run"
    job = Job(tmp_path, f"run.dir={run}", *LONG)
    deadline = time.monotonic() + 30
    while len(job.ranks()) < 2 and time.monotonic() < deadline:  # the ranks exist, still importing torch
        time.sleep(0.01)
    assert "step 1/" not in job.out.read_text()
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.wait() == 75, job.output()
    out = job.output()
    assert "SIGTERM received: stopped after step 1/400" in out, out
    assert os.path.exists(run / "checkpoints" / "step_000001" / "COMPLETE")
    assert "Traceback" not in out
    no_orphans(str(run))


def test_ctrl_c_to_the_process_group_prints_one_line(tmp_path):
    run = tmp_path / "run"
    job = Job(tmp_path, f"run.dir={run}", *LONG)
    job.wait_for("step 2/400")
    os.killpg(job.proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    assert job.wait() == 130, job.output()
    err = job.err.read_text().strip().splitlines()
    assert err == ["moe-dist train: interrupted (Ctrl-C): stopped 2 process(es); resume=auto continues from the last "
                   "complete checkpoint"], job.output()
    no_orphans(str(run))


def test_a_user_error_on_two_ranks_is_one_line_with_exit_code_2(tmp_path):
    job = Job(tmp_path, f"run.dir={tmp_path / 'run'}", f"data.corpus={tmp_path / 'no-such-corpus'}")
    assert job.wait() == 2, job.output()
    assert job.err.read_text().strip() == f"moe-dist train: error: data.corpus='{tmp_path / 'no-such-corpus'}' does not exist"


def test_a_rank_killed_by_the_system_is_named_in_one_line(tmp_path):
    run = tmp_path / "run"
    job = Job(tmp_path, f"run.dir={run}", *LONG)
    job.wait_for("step 2/400")
    rank1 = job.ranks()[1]
    os.kill(rank1, signal.SIGKILL)
    assert job.wait() == 128 + signal.SIGKILL, job.output()
    assert job.err.read_text().strip() == (f"moe-dist train: rank 1 (pid {rank1}) was killed by SIGKILL (out of memory?); "
                                           "the job stopped. resume=auto continues from the last complete checkpoint")
    no_orphans(str(run))


def test_a_stopped_rank_ends_the_job_within_the_timeout(tmp_path):
    run = tmp_path / "run"
    job = Job(tmp_path, f"run.dir={run}", "parallel.timeout_s=4", *LONG)
    job.wait_for("step 2/400")
    os.kill(job.ranks()[1], signal.SIGSTOP)
    t0 = time.monotonic()
    assert job.wait() == 1, job.output()
    assert time.monotonic() - t0 < 4 + 5 + 10  # the timeout, the launcher's grace, some slack
    err = job.err.read_text().strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moe-dist train: rank 0: the collective "), job.output()
    assert "group (ranks 0, 1) did not complete within parallel.timeout_s=4 s (called from moe_dist/" in err[0]
    no_orphans(str(run))


def test_a_killed_launcher_takes_its_ranks_along(tmp_path):
    run = tmp_path / "run"
    job = Job(tmp_path, f"run.dir={run}", *LONG)
    job.wait_for("step 1/400")
    os.kill(job.proc.pid, signal.SIGKILL)
    job.wait()
    no_orphans(str(run))


def test_a_second_run_on_a_live_run_directory_is_refused(tmp_path):
    run = tmp_path / "run"
    first = Job(tmp_path, f"run.dir={run}", *LONG, name="first")
    first.wait_for("step 2/400")
    # the first run stays live while the second starts, however fast it trains: its launcher and ranks are
    # stopped (a stopped process keeps its flock on run.lock; the kernel drops it only when the process ends)
    os.killpg(first.proc.pid, signal.SIGSTOP)
    try:
        second = Job(tmp_path, f"run.dir={run}", "train.steps=2", name="second")
        assert second.wait() == 2, second.output()
        err = second.err.read_text().strip()
        assert err.startswith(f"moe-dist train: error: run.dir='{run}' is in use by a live run (pid "), err
        assert "\n" not in err
        assert "step 2/400" in first.out.read_text() and first.proc.poll() is None  # untouched
        os.kill(first.ranks()[0], signal.SIGKILL)  # the holder dies without cleaning up
    except BaseException:
        os.killpg(first.proc.pid, signal.SIGKILL)  # never leave a stopped job behind
        raise
    os.killpg(first.proc.pid, signal.SIGCONT)  # the launcher sees rank 0's end and stops rank 1
    first.wait()
    third = Job(tmp_path, f"run.dir={run}", "train.steps=2", name="third")
    assert third.wait() == 0, third.output()  # a dead run leaves no lock behind
    no_orphans(str(run))


def _complete_checkpoints(run):
    return sorted(n for n in os.listdir(run / "checkpoints") if re.fullmatch(r"step_\d+", n))


def test_eval_reads_a_training_run_that_neither_starts_nor_prunes_under_it(tmp_path):
    from moe_dist.train.setup.run_lock import RunDirReadLock

    run = tmp_path / "run"
    run.mkdir()
    reader = RunDirReadLock(str(run))  # what `moe-dist eval` holds while it reads
    assert reader.acquire(wait_s=0) is None
    refused = Job(tmp_path, f"run.dir={run}", "train.steps=2", name="refused")
    assert refused.wait() == 2, refused.output()
    err = refused.err.read_text().strip()
    assert err.startswith(f"moe-dist train: error: run.dir='{run}' is being read by `moe-dist eval` (pid {os.getpid()} "
                          "on host ") and "\n" not in err, refused.output()
    assert set(os.listdir(run)) == {"read.lock", "run.lock"}  # nothing else made, moved or removed
    reader.release()

    # the training has to outlive the eval (another process, of its own speed) and the prune after it: a million
    # steps, each with a checkpoint (ckpt.every=1), take far longer than all the waits of this test together
    job = Job(tmp_path, f"run.dir={run}", f"train.steps={OUTLASTING_STEPS}", "run.print_every=1", "ckpt.every=1",
              "ckpt.keep=1", name="train")
    job.wait_for(f"step 3/{OUTLASTING_STEPS}")
    assert reader.acquire(wait_s=30) is None  # readers come in while the run trains
    job.wait_for("older checkpoints kept for now (ckpt.keep=1): `moe-dist eval` is reading the run directory")
    _, env = command()
    res = subprocess.run([sys.executable, "-m", "moe_dist.cli", "eval", "--run-dir", str(run)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr  # a real eval beside the training and the other reader
    result = json.load(open(run / "eval.json"))
    assert result["step"] >= 3 and (result["world_size"], result["ep"]) == (1, 1)
    assert len(_complete_checkpoints(run)) >= 2  # ckpt.keep=1, but nothing was removed under the readers
    assert job.proc.poll() is None  # the training went on
    pruned = job.out.read_text().count("checkpoint: removed")
    reader.release()
    deadline = time.monotonic() + 60
    while job.out.read_text().count("checkpoint: removed") == pruned and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job.out.read_text().count("checkpoint: removed") > pruned, job.output()  # the next save prunes again
    os.kill(job.proc.pid, signal.SIGTERM)
    assert job.wait() == 75, job.output()
    assert "Traceback" not in job.output()
    no_orphans(str(run))


def test_non_finite_steps_are_skipped_counted_and_never_saved(tmp_path):
    run = tmp_path / "run"
    job = Job(tmp_path, f"run.dir={run}", "train.lr=1e4", "train.warmup_steps=1", "ckpt.every=2", "train.steps=12",
              "train.max_nonfinite_steps=3")
    assert job.wait() == 1, job.output()
    err = job.err.read_text().strip()
    assert err == ("moe-dist train: training diverged: steps 2, 3, 4 were bad (3 within 20 steps = "
                   "train.max_nonfinite_steps within train.bad_step_window; a non-finite loss, gradient norm or router "
                   "logits, a loss or gradient-norm spike, or a collapse); the divergence began at step 2, so the last trusted state is step 0's. Lower train.lr (or "
                   "raise train.warmup_steps); resume=auto starts from step 0 (no checkpoint of step 0 or before; set "
                   "aside: step_000002.diverged); train.skip_divergent_batches=true also skips the batches of steps "
                   "1..2"), job.output()
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r.get("skipped", False) for r in rows] == [False, True, True, True]
    assert [r["skipped_steps"] for r in rows] == [0, 1, 2, 3]
    # the checkpoint of step 2 (a skipped step) holds the state after step 1: every tensor finite; it was set
    # aside (the state that led to the divergence); the stop at step 4 saved nothing
    assert sorted(os.listdir(run / "checkpoints")) == ["step_000002.diverged"]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(run / "checkpoints" / "step_000002.diverged"), str(tmp_path / "state.pt"))
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    floats = [v for v in state.values() if torch.is_tensor(v) and v.is_floating_point()]
    assert len(floats) > 20 and all(torch.isfinite(v).all() for v in floats)


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    run = tmp_path / "run"
    job = Job(tmp_path, f"run.dir={run}", "train.steps=4", "ckpt.every=2")
    assert job.wait() == 0, job.output()
    newest = run / "checkpoints" / "step_000004"
    data = next(p for p in sorted(newest.iterdir()) if p.name.endswith(".distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    job = Job(tmp_path, f"run.dir={run}", "train.steps=6", "resume=auto", name="resumed")
    assert job.wait() == 0, job.output()
    out = job.out.read_text()
    assert f"resume=auto: skipped {newest}: checkpoint {newest} is damaged" in out
    assert f"kept as {newest}.damaged; falling back to {run / 'checkpoints' / 'step_000002'}" in out
    assert "at step 2 " in out and "done: 6 steps" in out
    assert (run / "checkpoints" / "step_000004.damaged" / data.name).read_bytes() == bytes(raw)  # kept as it was
    job = Job(tmp_path, f"run.dir={run}", "train.steps=6", f"resume={newest}.damaged", name="explicit")
    assert job.wait() == 2, job.output()
    assert "is damaged and was not loaded" in job.err.read_text() and "SHA-256 differs" in job.err.read_text()


def _mount_tmpfs(path, size):
    path.mkdir()
    if shutil.which("mount") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_a_full_disk_is_one_line_and_resume_auto_recovers(tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "3m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        run = disk / "run"
        job = Job(tmp_path, f"run.dir={run}", "ckpt.every=2")
        assert job.wait() == 1, job.output()
        err = job.err.read_text().strip()
        assert err.startswith("moe-dist train: cannot save the checkpoint of step ") and "\n" not in err, job.output()
        assert f"no space left on the device of {run / 'checkpoints'}" in err and "MiB are free there now" in err
        left = sorted(os.listdir(run / "checkpoints"))
        assert any(n.endswith(".partial") for n in left), left
        # on the same full disk: the unfinished save is removed before anything is written
        job = Job(tmp_path, f"run.dir={run}", "resume=auto", "train.steps=6", "ckpt.save_final=false", name="resumed")
        assert job.wait() == 0, job.output()
        out = job.out.read_text()
        assert "left by a save that did not finish" in out and "done: 6 steps" in out
        assert not any(n.endswith(".partial") for n in os.listdir(run / "checkpoints"))
        assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")][-1] == 6
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.parametrize("script", ["torchrun.sh", "mpirun.sh"])
def test_launch_scripts_keep_the_exit_code_of_a_user_error_and_the_lock(tmp_path, script):
    if script == "mpirun.sh" and not (os.access(os.path.join(os.path.dirname(sys.executable), "mpirun"), os.X_OK)
                                      or shutil.which("mpirun")):
        pytest.skip("no mpirun (install the mpi extra)")
    _, env = command()
    env.update(PYTHON=sys.executable, NPROC_PER_NODE="2")
    args = [os.path.join(ROOT, "launch", script), *(["-n", "2"] if script == "mpirun.sh" else []), "configs/test.yaml",
            f"data.cache_dir={tmp_path / 'cache'}", "run.progress=false", "run.plots=false", "run.tensorboard=false"]
    res = subprocess.run(["bash", *args, f"run.dir={tmp_path / 'a'}", f"data.corpus={tmp_path / 'none'}"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr  # torchrun alone says 1, MPICH ORs the ranks' codes
    assert f"moe-dist train: error: data.corpus='{tmp_path / 'none'}' does not exist" in res.stderr
    # the run-directory lock holds under the scripts too: a live run in run.dir refuses this one
    from moe_dist.train.setup.run_lock import RunDirLock

    holder = RunDirLock(str(tmp_path / "b"))
    assert holder.acquire() is None
    try:
        res = subprocess.run(["bash", *args, f"run.dir={tmp_path / 'b'}"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    finally:
        holder.release()
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"moe-dist train: error: run.dir='{tmp_path / 'b'}' is in use by a live run (pid {os.getpid()} on host" \
        in res.stderr


def _worker_rank(pid):
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    return int(env[b"RANK"])


def test_torchrun_script_reports_a_failure_in_the_jobs_own_words(tmp_path):
    _, env = command()
    env.update(PYTHON=sys.executable, NPROC_PER_NODE="2")
    script = ["bash", os.path.join(ROOT, "launch", "torchrun.sh"), "configs/test.yaml",
              f"data.cache_dir={tmp_path / 'cache'}", "run.progress=false", "run.plots=false", "run.tensorboard=false"]
    # a user error: rank 0's one line, nothing of torchrun's (its ChildFailedError block, its log of the workers)
    res = subprocess.run([*script, f"run.dir={tmp_path / 'a'}", "train.bogus=1"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("moe-dist train: error: train.bogus: unknown config key; allowed "
                                                   "keys in train: ["), res.stderr
    assert res.stdout == ""
    # a rank killed by the system: one line naming it, in place of torchrun's report
    run = tmp_path / "b"
    out, err = tmp_path / "b.out", tmp_path / "b.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen([*script, f"run.dir={run}", *LONG], cwd=ROOT, env=env, stdout=o, stderr=e,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "step 2/400" not in out.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, out.read_text() + err.read_text()
            time.sleep(0.1)
        workers = [p for p in alive_with(str(run)) if "moe_dist.cli" in open(f"/proc/{p}/cmdline").read()
                   and "moe_dist.torchrun_launch" in open(f"/proc/{_ppid(p)}/cmdline").read()]
        rank1 = next(p for p in workers if _worker_rank(p) == 1)
        os.kill(rank1, signal.SIGKILL)
        assert proc.wait(120) == 1, out.read_text() + err.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = err.read_text().splitlines()
    assert (f"moe-dist train: rank 1 (pid {rank1}) was killed by SIGKILL (out of memory?); the job stopped. resume=auto "
            "continues from the last complete checkpoint") in lines, err.read_text()
    # rank 0 may have said that it lost its peer before torchrun stopped it: also one line, the job's own
    assert len(lines) <= 2 and all(line.startswith("moe-dist train: ") for line in lines), err.read_text()
    no_orphans(str(run))
