"""Running a study's grid: which runs are left, launching them side by side, progress, stop.

Each run is a ``moe-dist train`` process (with ``--nproc`` when the study asks for several
processes per run) started with ``resume=auto``, so a run that crashed or was stopped
continues from its latest complete checkpoint; a run whose ``summary.json`` covers all its
steps is skipped. Routers with an inference k are then evaluated at the study's ``eval_k``
(``moe-dist eval --k``, ``eval_k.json``). Runs are started in sessions of their own and,
when the cores suffice, each on its own cores (``os.sched_setaffinity``), so that two runs
side by side do not share a core and their timings stay comparable. Stopping the sweep
(Ctrl-C, SIGTERM) sends SIGTERM to every run: the trainer checkpoints at the next step and
exits with 75, and the next ``moe-dist sweep`` resumes it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, TextIO

from ..errors import UserError
from .collect import read_json
from .spec import RunSpec, Study

MARKER = "sweep_run.json"  # in each run directory: the overrides it was started with
LOG = "sweep.log"  # in each run directory: the output of its commands
EXIT_PREEMPTED = 75  # moe_dist.train.loop.preemption.EXIT_PREEMPTED (not imported: it pulls in torch)
STOP_GRACE_S = 300


@dataclass
class Job:
    run: RunSpec
    steps: int
    commands: list[list[str]]
    cores: Optional[list[int]] = None
    proc: Optional[subprocess.Popen] = None
    log: Optional[TextIO] = None
    started: float = 0.0
    status: str = "pending"  # pending | running | done | failed | stopped
    returncode: Optional[int] = None
    stage: str = ""


@dataclass
class Plan:
    todo: list[Job] = field(default_factory=list)
    finished: list[RunSpec] = field(default_factory=list)


def train_finished(run_dir: str, steps: int) -> bool:
    summary = read_json(os.path.join(run_dir, "summary.json"))
    return bool(summary) and summary.get("steps", 0) >= steps


def eval_k_finished(run_dir: str, ks: list[int]) -> bool:
    rows = read_json(os.path.join(run_dir, "eval_k.json"))
    return isinstance(rows, list) and sorted(r.get("k") for r in rows) == sorted(ks)


def inference_ks(study: Study, cfg) -> list[int]:
    """The study's eval_k values this run's router can use (none when it has no inference k)."""
    from ..moe.routers import ROUTERS

    if not study.eval_k or not ROUTERS[cfg.model.moe.router].has_inference_k:
        return []
    return [k for k in study.eval_k if k <= cfg.model.moe.num_experts]


def _check_marker(study: Study, run: RunSpec) -> None:
    """A run directory started with other settings is never continued silently."""
    marker = read_json(os.path.join(run.run_dir, MARKER))
    if marker is not None and (marker.get("overrides") != run.overrides or marker.get("base") != study.base):
        raise UserError(f"{run.run_dir} was started with other settings (see its {MARKER}); "
                        "delete that directory or give the study another out: directory")
    if marker is None and os.path.isdir(run.run_dir) and os.listdir(run.run_dir):
        raise UserError(f"{run.run_dir} exists and was not written by `moe-dist sweep` (no {MARKER}); "
                        "delete it or give the study another out: directory")


def cli_command(study: Study, *args: str) -> list[str]:
    nproc = ["--nproc", str(study.processes_per_run)] if study.processes_per_run > 1 else []
    return [sys.executable, "-m", "moe_dist.cli", args[0], *nproc, *args[1:]]


def plan(study: Study, configs: dict) -> Plan:
    """Split the grid into finished runs and jobs (train and/or eval commands), in grid order."""
    out = Plan()
    for run in study.runs:
        _check_marker(study, run)
        cfg = configs[run.name]
        ks = inference_ks(study, cfg)
        commands = []
        if not train_finished(run.run_dir, cfg.train.steps):
            commands.append(cli_command(study, "train", "--config", study.base, *run.overrides, "resume=auto"))
        if ks and (commands or not eval_k_finished(run.run_dir, ks)):
            commands.append(cli_command(study, "eval", "--run-dir", run.run_dir, "--k", ",".join(map(str, ks)),
                                        f"run.threads={study.threads_per_run}"))
        if commands:
            out.todo.append(Job(run=run, steps=cfg.train.steps, commands=commands))
        else:
            out.finished.append(run)
    return out


def core_slots(study: Study) -> list[Optional[list[int]]]:
    """Disjoint core sets, one per concurrent run, when the usable cores suffice (else no pinning)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:
        return [None] * study.runs_at_once
    per_run = study.processes_per_run * study.threads_per_run
    if per_run * study.runs_at_once > len(cores):
        return [None] * study.runs_at_once
    return [cores[i * per_run:(i + 1) * per_run] for i in range(study.runs_at_once)]


def _child_env() -> dict:
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # each run is a job of its own
    return env


def _last_step(run_dir: str) -> int:
    """The step of metrics.jsonl's last row (reads only the file's tail)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().decode("utf-8", "replace").strip().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


class Progress:
    """One status line: rewritten in place on a terminal, printed on changes (and every minute) otherwise."""

    def __init__(self, total: int, done: int, runs_at_once: int = 1, stream: TextIO = sys.stderr):
        self.total, self.done, self.failed, self.runs_at_once = total, done, 0, runs_at_once
        self.durations: list[float] = []  # of the runs this invocation finished
        self.stream, self.tty = stream, stream.isatty()
        self.t0 = time.monotonic()
        self._last_print, self._last_key = 0.0, None

    def event(self, msg: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        self.stream.write(f"[sweep] {msg}\n")
        self.stream.flush()

    def update(self, running: list[Job]) -> None:
        elapsed = time.monotonic() - self.t0
        parts = [f"{j.run.name} {j.stage}" for j in running]
        eta = ""
        if self.durations:  # the remaining runs at the mean duration so far, runs_at_once at a time
            left = (self.total - self.done - self.failed) * statistics.fmean(self.durations) / self.runs_at_once
            eta = f", about {_minutes(left)} left"
        text = (f"[sweep] {self.done}/{self.total} done" + (f", {self.failed} failed" if self.failed else "")
                + f", {len(running)} running" + (f": {', '.join(parts)}" if parts else "")
                + f"  [{_minutes(elapsed)}{eta}]")
        if self.tty:
            width = max(40, shutil.get_terminal_size().columns - 1)
            self.stream.write("\r\033[K" + text[:width])
            self.stream.flush()
        else:  # a log file: on a change of the running set, and once a minute
            key = (self.done, self.failed, tuple(j.run.name for j in running))
            if key != self._last_key or time.monotonic() - self._last_print > 60:
                self.stream.write(text + "\n")
                self.stream.flush()
                self._last_print, self._last_key = time.monotonic(), key

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def _start(job: Job, study: Study) -> None:
    cmd = job.commands.pop(0)
    os.makedirs(job.run.run_dir, exist_ok=True)
    with open(os.path.join(job.run.run_dir, MARKER), "w", encoding="utf-8") as f:
        json.dump({"study": os.path.abspath(study.path), "base": study.base, **job.run.as_dict()}, f, indent=2)
    if job.log is None:
        job.log = open(os.path.join(job.run.run_dir, LOG), "a", encoding="utf-8")
    job.log.write(f"\n$ {' '.join(cmd)}\n")
    job.log.flush()
    job.stage = cmd[3]  # train | eval
    cores = job.cores
    preexec = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    job.proc = subprocess.Popen(cmd, stdout=job.log, stderr=subprocess.STDOUT, env=_child_env(),
                                start_new_session=True, preexec_fn=preexec)
    if not job.started:
        job.started = time.monotonic()
    job.status = "running"


class _StopRequest(Exception):
    pass


def execute(study: Study, todo: list[Job], progress: Progress,
            on_finish: Optional[Callable[[Job], None]] = None, poll_s: float = 0.5) -> list[Job]:
    """Run the jobs, ``study.runs_at_once`` at a time. Returns every job with its final status.
    On SIGINT/SIGTERM: SIGTERM to every running run, wait for their checkpoints, raise KeyboardInterrupt."""
    pending, running, ended = list(todo), [], []
    free = core_slots(study)

    def stop(signum, frame):
        raise _StopRequest()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM,)}
    try:
        while pending or running:
            while pending and free:
                job = pending.pop(0)
                job.cores = free.pop(0)
                _start(job, study)
                running.append(job)
                progress.event(f"start {job.run.name} ({job.stage})" + (f" on cores {job.cores}" if job.cores else ""))
            for job in list(running):
                code = job.proc.poll()
                if code is None:
                    if job.stage.startswith("train"):
                        job.stage = f"train {_last_step(job.run.run_dir)}/{job.steps}"
                    continue
                if code == 0 and job.commands:
                    _start(job, study)  # the next command of the same run, on the same cores
                    continue
                job.returncode, job.status = code, ("done" if code == 0 else "failed")
                job.log.close()
                free.append(job.cores)
                running.remove(job)
                ended.append(job)
                if job.status == "done":
                    progress.done += 1
                    progress.durations.append(time.monotonic() - job.started)
                    progress.event(f"done  {job.run.name} in {time.monotonic() - job.started:.0f}s")
                else:
                    progress.failed += 1
                    progress.event(f"FAILED {job.run.name} (exit {code}); see {os.path.join(job.run.run_dir, LOG)}")
                if on_finish:
                    on_finish(job)
            progress.update(running)
            if pending or running:
                time.sleep(poll_s)
    except (KeyboardInterrupt, _StopRequest):
        progress.event(f"stopping: SIGTERM to {len(running)} run(s); each checkpoints and exits (resume with the "
                       "same command)")
        _terminate(running)
        raise KeyboardInterrupt from None
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        progress.close()
    return ended


def _terminate(jobs: list[Job]) -> None:
    for job in jobs:
        try:
            os.killpg(job.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + STOP_GRACE_S
    for job in jobs:
        try:
            job.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(job.proc.pid, signal.SIGKILL)
            job.proc.wait()
        job.status, job.returncode = "stopped", job.proc.returncode
        if job.log:
            job.log.close()

