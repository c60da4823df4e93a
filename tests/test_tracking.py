"""Weights & Biases tracking (``log.wandb``) in offline mode, read back with wandb's own reader of
its run files (``wandb leet inspect --json``): a 2-rank `moe-dist train --nproc 2` run, then a
resume from an earlier checkpoint that continues the same W&B run without sending a step twice, and
whose TensorBoard events, read with TensorBoard's own loader, show every step once.
Nothing leaves the machine: WANDB_MODE=offline, and wandb's settings, cache and data go to a
temporary directory."""
import glob
import json
import os
import subprocess
import sys

import pytest

from moe_dist.config import ConfigError, config_to_dict, load_config
from moe_dist.train.observe.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
wandb = pytest.importorskip("wandb", reason="the wandb extra is not installed (EXTRAS=dev,wandb bash scripts/setup.sh)")

STEPS, CKPT_AT, RESUMED_STEPS = 6, 4, 8  # run 1 logs steps 1-6, checkpoint at 4; run 2 resumes at 4, runs to 8


def offline_env(tmp) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT") and not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_ERROR_REPORTING="false",
               WANDB_CONFIG_DIR=str(tmp / "wandb-config"), WANDB_CACHE_DIR=str(tmp / "wandb-cache"),
               WANDB_DATA_DIR=str(tmp / "wandb-data"))
    return env


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B in this process, offline; wandb reads the environment once per process (its settings
    singleton), so it is torn down before and after: each test sees its own environment."""
    for key, value in offline_env(tmp_path).items():
        if key.startswith("WANDB_"):
            monkeypatch.setenv(key, value)
    wandb.teardown()
    yield tmp_path
    wandb.teardown()


def moe_dist(env, *args, timeout=400):
    script = os.path.join(os.path.dirname(sys.executable), "moe-dist")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "moe_dist.cli"]
    return subprocess.run(cmd + list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def wandb_runs(run_dir, env, cwd) -> list[list[dict]]:
    """The records of each offline W&B run file under ``run_dir/wandb``, oldest first, as wandb's
    own reader prints them (``wandb leet inspect --json``: one JSON record per line)."""
    out = []
    for path in glob.glob(os.path.join(run_dir, "wandb", "offline-run-*")):
        res = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", path], cwd=cwd, env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        out.append([json.loads(line) for line in res.stdout.splitlines() if line.strip()])
    return sorted(out, key=lambda records: run_record(records)["start_time"])


def run_record(records: list[dict]) -> dict:
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    return run


def history(records: list[dict]) -> dict[int, dict]:
    """``{step: logged entries}``; a step logged twice in one file fails here."""
    rows = [(r["history"]["step"]["num"], r["history"]["item"]) for r in records if r["type"] == "history"]
    steps = [s for s, _ in rows]
    assert len(steps) == len(set(steps)), steps
    return dict(rows)


def final_summary(records: list[dict]) -> dict:
    out = {}
    for r in records:
        if r["type"] == "summary":
            out.update(r["summary"].get("update", {}))
    return out


def assert_row_logged(item: dict, row: dict) -> None:
    """Every field of a metrics.jsonl row is in the W&B entries of its step."""
    for key, value in row.items():
        if key in ("step", "moe"):
            continue
        tag = f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"
        assert item[tag] == pytest.approx(float(value)), tag
    for layer, stats in row["moe"].items():
        for key, value in stats.items():
            tag = f"moe_layer{layer}/{key}"
            if isinstance(value, list):  # per expert: a histogram over the expert index
                assert item[f"{tag}._type"] == "histogram", tag
                assert item[f"{tag}.bins"] == list(range(len(value) + 1)), tag
                assert item[f"{tag}.values"] == pytest.approx(value), tag
            else:
                assert item[tag] == pytest.approx(float(value)), tag
        counts = stats["expert_counts"]
        assert item[f"moe_layer{layer}/max_load_ratio"] == pytest.approx(max(counts) * len(counts) / sum(counts))


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Run 1: 2 ranks, steps 1-6, a checkpoint at step 4 only. Run 2: resume=auto from it, to step 8."""
    tmp = tmp_path_factory.mktemp("wandb")
    env, run_dir = offline_env(tmp), tmp / "run"
    common = ["train", "--config", "configs/test.yaml", "--nproc", "2", f"run.dir={run_dir}",
              f"data.cache_dir={tmp}/cache", "run.progress=false", "run.plots=false", "run.tensorboard=true",
              "log.wandb=true", "log.wandb_project=moe-test", "log.wandb_tags=[ci,offline]",
              "model.moe.expert_bias=true", "eval.probe_every=2", f"ckpt.every={CKPT_AT}", "ckpt.save_final=false"]
    first = moe_dist(env, *common, f"train.steps={STEPS}")
    assert first.returncode == 0, first.stdout + first.stderr
    rows_first = read_metrics(str(run_dir / "metrics.jsonl"))
    # config.yaml names run.dir as ${config_dir}; read as a config it is the resolved config again
    config_first = json.loads(json.dumps(config_to_dict(load_config(str(run_dir / "config.yaml")))))
    records_first = wandb_runs(run_dir, env, tmp)
    second = moe_dist(env, *common, f"train.steps={RESUMED_STEPS}", "resume=auto")
    assert second.returncode == 0, second.stdout + second.stderr
    return {"dir": run_dir, "env": env, "tmp": tmp, "first": first, "second": second, "rows_first": rows_first,
            "config_first": config_first, "records_first": records_first}


@pytest.mark.slow
def test_offline_run_logs_every_metrics_row_config_and_summary(two_runs):
    (records,) = two_runs["records_first"]  # rank 0 alone logs: one W&B run
    rows = two_runs["rows_first"]
    run = run_record(records)
    state = json.load(open(two_runs["dir"] / "wandb_run.json"))
    assert run["run_id"] == state["id"] and run["project"] == "moe-test" and run["display_name"] == "run"
    assert "wandb: run " + state["id"] + ", offline in " in two_runs["first"].stdout

    config = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert config == two_runs["config_first"]  # the resolved config, overrides included
    assert config["train"]["steps"] == STEPS and config["model"]["vocab_size"] == 512

    logged = history(records)
    assert sorted(logged) == [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert_row_logged(logged[row["step"]], row)
    # the routing-fluctuation curve: the probe steps, the same as metrics.jsonl's
    probes = [r["step"] for r in rows if "fluct_top1" in r["moe"]["0"]]
    assert probes == [2, 4, 6]
    assert [s for s in sorted(logged) if "moe_layer0/fluct_top1" in logged[s]] == probes
    assert all(f"moe_layer{i}/expert_bias.values" in logged[s] for s in logged for i in (0, 1))

    summary = final_summary(records)  # (summary.json itself is the resumed run's by now)
    assert summary["steps"] == STEPS and summary["val_loss"] == pytest.approx(rows[-1]["val_loss"])
    assert summary["routing"]["0"]["probes"] == 3 and summary["routing"]["1"]["num_experts"] == 4
    exits = [r["exit"] for r in records if r["type"] == "exit"]
    assert len(exits) == 1 and exits[0].get("exit_code", 0) == 0


@pytest.mark.slow
def test_resume_continues_the_same_run_without_duplicated_steps(two_runs):
    d = two_runs["dir"]
    runs = wandb_runs(d, two_runs["env"], two_runs["tmp"])
    assert len(runs) == 2  # the first run's file, then the resumed run's
    first, second = runs
    ids = {run_record(r)["run_id"] for r in runs}
    assert ids == {json.load(open(d / "wandb_run.json"))["id"]}
    assert run_record(second)["resume"] is True
    assert f"continued after step {STEPS} (steps {CKPT_AT + 1}..{STEPS} replayed now are not sent again)" \
        in two_runs["second"].stdout

    steps_first, steps_second = sorted(history(first)), sorted(history(second))
    assert steps_first == list(range(1, STEPS + 1))
    assert steps_second == list(range(STEPS + 1, RESUMED_STEPS + 1))  # replayed steps 5-6 were not sent again
    rows = read_metrics(str(d / "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, RESUMED_STEPS + 1))  # rewound to 4, then 5-8
    logged = history(second)
    for row in rows[STEPS:]:
        assert_row_logged(logged[row["step"]], row)
    assert json.load(open(d / "wandb_run.json"))["last_step"] == RESUMED_STEPS

    config = run_record(second)["config"]["update"]
    assert config["train"]["steps"] == RESUMED_STEPS and config["resume"] == "auto"
    summary = final_summary(second)
    assert summary["steps"] == RESUMED_STEPS
    assert summary["val_loss"] == pytest.approx(json.load(open(d / "summary.json"))["val_loss"])


@pytest.mark.slow
def test_tensorboard_shows_every_step_once_after_a_resume(two_runs):
    """Run 1 logged steps 1-6, run 2 replayed 5-6 from the step-4 checkpoint: TensorBoard's loader
    (which applies the resumed writer's purge step) sees steps 1-8 once, 5-8 with the replayed values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d = two_runs["dir"]
    assert len(glob.glob(str(d / "tb" / "events.out.tfevents.*"))) == 2  # one file per run
    acc = EventAccumulator(str(d / "tb"))
    acc.Reload()
    rows = read_metrics(str(d / "metrics.jsonl"))
    for tag, value in (("train/loss", lambda r: r["loss"]), ("moe_layer0/aux_loss", lambda r: r["moe"]["0"]["aux_loss"])):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == list(range(1, RESUMED_STEPS + 1)), tag
        assert [e.value for e in events] == pytest.approx([value(r) for r in rows], rel=1e-6), tag


def test_a_new_timeline_starts_a_new_run_and_a_resume_continues_it(offline, monkeypatch):
    """resume=none: a new W&B run (new id in run.dir/wandb_run.json); otherwise the kept id and last
    step. log.wandb_mode, when set, wins over WANDB_MODE (here: disabled, which would write nothing)."""
    from moe_dist.train.observe.tracking import WandbTracker, read_state, write_state

    monkeypatch.setenv("WANDB_MODE", "disabled")
    wandb.teardown()  # read the environment again
    run_dir = offline / "run"
    os.makedirs(run_dir)
    cfg = load_config("configs/test.yaml", [f"run.dir={run_dir}", "log.wandb=true", "log.wandb_mode=offline"])
    write_state(str(run_dir), {"id": "kept0001", "last_step": 7})
    tracker = WandbTracker.start(cfg, new_timeline=False)
    try:
        assert (tracker.run.id, tracker.last_step) == ("kept0001", 7)
        assert tracker.run.offline and glob.glob(str(run_dir / "wandb" / "offline-run-*-kept0001"))
        assert tracker.describe(3).endswith("continued after step 7 (steps 4..7 replayed now are not sent again)")
    finally:
        tracker.finish()
    tracker = WandbTracker.start(cfg, new_timeline=True)
    try:
        assert tracker.run.id != "kept0001" and tracker.last_step == 0
        assert read_state(str(run_dir)) == {"id": tracker.run.id, "last_step": 0}
    finally:
        tracker.finish()


def test_a_preempted_run_ends_preempting_with_exit_code_75(offline):
    """A run stopped by SIGTERM/SIGUSR1 after its checkpoint: the W&B run is marked preempting and
    ends with the process's exit code; the last step sent is kept for the requeued run."""
    from moe_dist.train.loop.preemption import Preempted
    from moe_dist.train.observe.tracking import WandbTracker, read_state

    run_dir = offline / "run"
    os.makedirs(run_dir)
    cfg = load_config("configs/test.yaml", [f"run.dir={run_dir}", "log.wandb=true"])
    tracker = WandbTracker.start(cfg, new_timeline=True)
    tracker.log({"step": 1, "loss": 5.0, "moe": {}})
    tracker.finish(Preempted(1, "SIGTERM"))
    (records,) = wandb_runs(run_dir, offline_env(offline), offline)
    assert [r["type"] for r in records].count("preempting") == 1
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [75]
    assert history(records)[1]["train/loss"] == 5.0
    assert read_state(str(run_dir))["last_step"] == 1


def test_refused_before_launch_without_the_package(tmp_path):
    """`moe-dist train --nproc 2 log.wandb=true` where wandb cannot be imported: one line naming the key
    and the install command, exit 2, and no rank started (run.dir untouched)."""
    run_dir = tmp_path / "run"
    code = ("import sys; sys.modules['wandb'] = None; from moe_dist.cli import main; "
            f"sys.exit(main(['train', '--config', 'configs/test.yaml', '--nproc', '2', 'run.dir={run_dir}', "
            "'log.wandb=true']))")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moe-dist train: error: log.wandb: true needs the wandb package")
    assert f"-m pip install -e '{ROOT}[wandb]'" in lines[0]
    assert not run_dir.exists()


def test_every_rank_refuses_without_the_package(tmp_path, monkeypatch):
    """Without the launcher's preflight (torchrun, srun, one process) the trainer refuses before it
    touches run.dir."""
    from moe_dist.train.loop.trainer import train

    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = load_config("configs/test.yaml", [f"run.dir={tmp_path / 'run'}", "log.wandb=true", "parallel.ep=1"])
    with pytest.raises(ConfigError, match=r"log\.wandb: true needs the wandb package"):
        train(cfg)
    assert not (tmp_path / "run").exists()


def test_a_profiled_steps_time_split_goes_to_wandb_under_tensorboards_names():
    from moe_dist.train.observe.tracking import wandb_row

    row = {"step": 20, "loss": 3.0, "mfu": 0.12, "time": {"compute_s": 1.5, "a2a_s": 0.25}, "moe": {}}
    assert wandb_row(row) == {"train/loss": 3.0, "train/mfu": 0.12, "time/compute_s": 1.5, "time/a2a_s": 0.25}
