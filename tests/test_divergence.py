"""Divergence with real runs of `moe-dist train` (configs/test.yaml): the checkpoints written after
the last healthy state are set aside and resume=auto continues from before the divergence
(optionally skipping its batches), automatic rollbacks, the skipped-step count across resumes,
NaN router logits as skipped steps, and the DeepSpeed engine skipping non-finite steps."""
import json
import math
import os
from collections import deque
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def train(tmp, run, *args, nproc=2):
    """`moe-dist train --nproc N` on configs/test.yaml; returns (exit code, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    ep = [] if nproc == 2 else ["parallel.ep=1"]
    cmd = [sys.executable, "-m", "moe_dist.cli", "train", "--config", "configs/test.yaml", "--nproc", str(nproc),
           "run.progress=false", "run.plots=false", "run.tensorboard=false", f"run.dir={run}",
           f"data.cache_dir={tmp / 'cache'}", *ep, *args]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return res.returncode, res.stdout, res.stderr


def rows(run):
    with open(run / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def listing(run):
    return sorted(os.listdir(run / "checkpoints"))


def all_finite(checkpoint, tmp):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(checkpoint), str(tmp / "state.pt"))
    state = torch.load(tmp / "state.pt", weights_only=True)
    floats = [v for v in state.values() if torch.is_tensor(v) and v.is_floating_point()]
    return len(floats) > 20 and all(torch.isfinite(v).all() for v in floats)


def test_a_divergence_sets_aside_later_checkpoints_and_resume_auto_continues_before_it(tmp_path):
    """4 sane steps, then train.lr=10000 to step 12 (2 ranks; one automatic rollback, then the stop),
    then resume=auto with a sane rate on 1 rank, skipping the batches of the divergence."""
    run = tmp_path / "run"
    code, out, err = train(tmp_path, run, "train.steps=4", "ckpt.every=2")
    assert code == 0, out + err
    code, out, err = train(tmp_path, run, "train.steps=12", "ckpt.every=2", "train.lr=10000", "resume=auto",
                           "train.max_nonfinite_steps=2", "train.on_divergence=rollback", "train.max_rollbacks=1")
    assert code == 1, out + err
    record = json.loads((run / "divergence.json").read_text())
    pending = record["pending"]
    first, good = pending["first_bad_step"], pending["last_good_step"]
    assert good == first - 2 >= 4  # the 4 sane steps are trusted
    # the first divergence rolled back (the same one, deterministic), the second stopped
    assert out.count("rolling back (1 of train.max_rollbacks=1): resume=auto continues from ") == 1
    assert [(e["first_bad_step"], e["automatic"], e["resumed_at"]) for e in record["history"]] == [(first, True, good)]
    assert [r["rollback"]["automatic"] for r in rows(run) if "rollback" in r] == [True]
    assert not pending["automatic"] and pending["rollbacks"] == 1
    kept = [n for n in listing(run) if n.startswith("step_") and n[5:].isdigit()]
    aside = [n for n in listing(run) if ".diverged" in n]
    assert kept and all(int(n[5:]) <= good for n in kept) and kept[-1] == f"step_{good:06d}"
    assert aside and all(int(n[5:11]) > good for n in aside)
    assert all(n.startswith("step_") for n in listing(run))
    resume_step = good
    assert pending["resume_from"] == str(run / "checkpoints" / kept[-1]) and pending["resume_step"] == resume_step
    assert err.count("\n") == 1 and err.startswith("moe-dist train: training diverged: ")
    assert " after 1 rollback(s) (train.max_rollbacks=1); " in err
    assert f"resume=auto continues from {run / 'checkpoints' / kept[-1]} (step {resume_step}; set aside: " in err
    assert f"train.skip_divergent_batches=true also skips the batches of steps {resume_step + 1}..{first}" in err
    skipped = pending["skipped_steps"]
    assert skipped == rows(run)[-1]["skipped_steps"] >= 2

    code, out, err = train(tmp_path, run, "train.steps=8", "ckpt.every=2", "train.lr=0.002", "resume=auto",
                           "train.skip_divergent_batches=true", nproc=1)
    assert code == 0, out + err
    assert f"resumed from {run / 'checkpoints' / kept[-1]} at step {resume_step} (saved by 2 rank(s)" in out
    assert f"resume: skipped the batches of steps {resume_step + 1}..{first}" in out
    after = [r for r in rows(run) if r["step"] > resume_step]
    back = [r for r in rows(run) if "rollback" in r]
    assert back[-1] == {"step": resume_step, "rollback": {
        "first_bad_step": first, "stopped_at": pending["stopped_at"], "resumed_at": resume_step,
        "skipped_batches": first - resume_step, "automatic": False}}
    assert [r["step"] for r in after] == list(range(resume_step + 1, 9))
    assert not any(r.get("skipped") for r in after) and all(r["skipped_steps"] == skipped for r in after)
    record = json.loads((run / "divergence.json").read_text())
    assert record["pending"] is None and record["history"][-1]["resumed_at"] == resume_step
    meta = json.loads((run / "checkpoints" / "step_000008" / "meta.json").read_text())
    assert meta["sampler"]["consumed"] == (8 + first - resume_step) * 8  # the skipped batches stay skipped
    assert meta["counters"]["skipped_steps"] == skipped
    assert json.loads((run / "summary.json").read_text())["skipped_steps"] == skipped


def poisoned_run(tmp, run, poison, *args):
    """tests/helpers/divergence_case.py: configs/test.yaml on 1 process, the loss of step 6 poisoned; (stdout, summary)."""
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "helpers", "divergence_case.py"), str(run),
                          str(tmp / "cache"), poison, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout, json.loads(res.stdout.split("SUMMARY ")[-1])


@pytest.mark.parametrize("engine", ["native", "deepspeed"])
def test_a_rollback_recovers_a_run_and_the_summary_lists_it(tmp_path, engine):
    """One poisoned loss (a NaN at step 6) makes the run roll back to step 4's checkpoint, skip the
    batches of steps 5-6, and finish."""
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    run = tmp_path / "run"
    out, summary = poisoned_run(tmp_path, run, "nan", f"train.engine={engine}", "train.skip_divergent_batches=true")
    event = {"first_bad_step": 6, "stopped_at": 6, "resumed_at": 4, "skipped_batches": 2, "automatic": True}
    assert summary == {"steps": 8, "rollbacks": [event], "skipped_steps": 1}
    assert "rolling back (1 of train.max_rollbacks=3): resume=auto continues from " in out
    assert [(r["step"], r.get("skipped", False)) for r in rows(run) if "loss" in r] == [
        (s, False) for s in range(1, 9)]  # the skipped step 6 was rolled back with its row
    assert [r for r in rows(run) if "rollback" in r] == [{"step": 4, "rollback": event}]
    assert listing(run) == ["step_000002", "step_000004", "step_000006", "step_000008"]
    meta = json.loads((run / "checkpoints" / "step_000008" / "meta.json").read_text())
    assert meta["sampler"]["consumed"] == (8 + 2) * 8 and meta["counters"]["rollbacks"] == 1


@pytest.mark.parametrize("engine", ["native", "deepspeed"])
def test_a_loss_spike_is_a_skipped_step_that_changes_nothing(tmp_path, engine):
    """A finite loss 10x the recent median (train.spike_factor=3) at step 6: skipped, so the
    checkpoints of steps 5 and 6 hold the same weights and optimizer state; training goes on."""
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    run = tmp_path / "run"
    out, summary = poisoned_run(tmp_path, run, "spike", f"train.engine={engine}", "train.spike_factor=3",
                                "train.spike_window=3", "train.max_nonfinite_steps=2", "ckpt.every=1")
    assert summary == {"steps": 8, "rollbacks": [], "skipped_steps": 1}
    assert "step 6: loss " in out and " spiked over train.spike_factor=3.0 x the median " in out
    assert [(r["step"], r.get("skipped", False), r.get("spike", False)) for r in rows(run) if r["step"] in (5, 6, 7)] == [
        (5, False, False), (6, True, True), (7, False, False)]
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    states = []
    for step in (5, 6, 7):
        dcp_to_torch_save(str(run / "checkpoints" / f"step_{step:06d}"), str(tmp_path / f"{step}.pt"))
        state = torch.load(tmp_path / f"{step}.pt", weights_only=True)
        states.append({k: v for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()
                       and not k.startswith("rng.")})
    assert len(states[0]) > 20 and states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])  # step 6 changed nothing
    assert not all(torch.equal(states[1][k], states[2][k]) for k in states[1])  # step 7 did
    # a resume continues the skipped-step count (a fresh process: no poisoned step in its 2 steps)
    out, summary = poisoned_run(tmp_path, run, "spike", f"train.engine={engine}", "train.steps=10", "resume=auto")
    assert summary == {"steps": 10, "rollbacks": [], "skipped_steps": 1}
    assert [r["skipped_steps"] for r in rows(run)] == [0] * 5 + [1] * 5


def test_nan_router_logits_are_skipped_steps_on_two_ranks(tmp_path):
    run = tmp_path / "run"
    code, out, err = train(tmp_path, run, "train.lr=1e15", "train.warmup_steps=0", "train.steps=10",
                           "train.max_nonfinite_steps=3")
    assert code == 1, out + err
    assert "Traceback" not in out + err and "FloatingPointError" not in out + err
    assert err.count("\n") == 1 and err.startswith("moe-dist train: training diverged: steps 2, 3, 4 were bad"), err
    assert "step 2: router logits not finite (layer 0: " in out
    got = [(r["step"], r.get("skipped", False), "router_nonfinite" in r, r["skipped_steps"]) for r in rows(run)]
    assert got[0] == (1, False, False, 0) and got[1:] == [(2, True, True, 1), (3, True, True, 2), (4, True, True, 3)]


def test_deepspeed_skips_non_finite_steps_and_saves_only_finite_state(tmp_path):
    pytest.importorskip("deepspeed")
    run = tmp_path / "run"
    code, out, err = train(tmp_path, run, "train.engine=deepspeed", "train.lr=1e4", "train.warmup_steps=1",
                           "ckpt.every=2", "train.steps=12", "train.max_nonfinite_steps=3", nproc=1)
    assert code == 1, out + err
    assert err.strip().splitlines()[-1].startswith("moe-dist train: training diverged: steps 2, 3, 4 were bad")
    assert [(r["step"], r.get("skipped", False)) for r in rows(run)] == [(1, False), (2, True), (3, True), (4, True)]
    assert listing(run) == ["step_000002.diverged"]  # saved at a skipped step: the state after step 1
    assert all_finite(run / "checkpoints" / "step_000002.diverged", tmp_path)


def _complete(run, step):
    """A directory that scan() counts as the complete checkpoint of ``step`` (a manifest, no tensors)."""
    from moe_dist.train.checkpoint.files import FORMAT, FORMAT_VERSION, MARKER, step_dir

    path = step_dir(str(run), step)
    os.makedirs(path)
    with open(os.path.join(path, MARKER), "w") as f:
        json.dump({"format": FORMAT, "version": FORMAT_VERSION, "files": {}}, f)


def test_checkpoints_a_reader_holds_are_set_aside_at_the_next_start(tmp_path):
    """While `moe-dist eval` holds read.lock, a divergence moves nothing; the next start does."""
    from moe_dist.train.checkpoint.divergence import read_record, record_divergence, set_aside_pending
    from moe_dist.train.setup.run_lock import RunDirReadLock

    run = tmp_path / "run"
    for step in (2, 4, 6, 8):
        _complete(run, step)
    reader = RunDirReadLock(str(run))
    assert reader.acquire(wait_s=0) is None
    event = record_divergence(str(run), {"first_bad_step": 7, "last_good_step": 5, "stopped_at": 9}, rollback=True)
    assert event["set_aside"] == ["step_000006.diverged", "step_000008.diverged"] and event["set_aside_later"]
    assert event["resume_from"] == str(run / "checkpoints" / "step_000004") and event["automatic"]
    assert listing(run) == ["step_000002", "step_000004", "step_000006", "step_000008"]  # untouched
    reader.release()
    assert [os.path.basename(p) for p in set_aside_pending(str(run))] == event["set_aside"]
    assert listing(run) == ["step_000002", "step_000004", "step_000006.diverged", "step_000008.diverged"]
    assert set_aside_pending(str(run)) == [] and read_record(str(run))["pending"]["first_bad_step"] == 7
    event = record_divergence(str(run), {"first_bad_step": 3, "last_good_step": 1, "stopped_at": 5}, rollback=True)
    assert event["set_aside"] == ["step_000002.diverged", "step_000004.diverged"] and not event["set_aside_later"]
    assert event["resume_from"] is None and not event["automatic"]  # no checkpoint to roll back to
    assert len(read_record(str(run))["history"]) == 1  # the first event, never resumed from


@pytest.mark.parametrize("engine,nproc", [("native", 1), ("native", 2), ("deepspeed", 1)])
def test_a_collapse_that_stays_finite_is_a_divergence(tmp_path, engine, nproc):
    """4 sane steps, then train.lr=1000: besides the non-finite steps (skipped) the model collapses
    while staying finite (a gradient norm orders of magnitude over the recent ones, a zero gradient, a
    loss back at ln(vocab)); those applied steps are bad too, bad steps that are not consecutive add up
    within train.bad_step_window, and the run stops with exit code 1 instead of saving the collapsed
    model. resume=auto with a sane rate then continues from before the divergence and learns."""
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    run = tmp_path / "run"
    common = ["ckpt.every=2", f"train.engine={engine}"]
    code, out, err = train(tmp_path, run, "train.steps=4", *common, nproc=nproc)
    assert code == 0, out + err
    code, out, err = train(tmp_path, run, "train.steps=12", "train.lr=1000", "resume=auto", *common, nproc=nproc)
    assert code == 1, out + err
    assert err.strip().splitlines()[-1].startswith("moe-dist train: training diverged: steps "), err
    bad = [r for r in rows(run) if r.get("bad")]
    applied = [r for r in bad if not r.get("skipped")]
    # (DeepSpeed's ZeRO step overflows on every one of these steps: all skipped, none applied)
    assert len(bad) == 5 and (applied or engine == "deepspeed"), [(r["step"], r.get("skipped"), r.get("bad"), r["grad_norm"], r["loss"]) for r in rows(run)]
    assert all("spiked over train.grad_spike_factor" in r["bad"] or "collapsed" in r["bad"] for r in applied), applied
    steps = [r["step"] for r in bad]
    assert not any(n.startswith("step_") and n[5:].isdigit() and int(n[5:]) >= steps[0] for n in listing(run)), \
        listing(run)  # nothing saved from the collapse stays a checkpoint resume=auto would take
    code, out, err = train(tmp_path, run, "train.steps=12", "train.lr=0.01", "resume=auto", *common, nproc=nproc)
    assert code == 0, out + err
    last = rows(run)[-1]
    assert last["step"] == 12 and not last.get("bad") and last["loss"] < 0.95 * math.log(512), last


def _health(**train):
    """The trainer's bad-step bookkeeping alone (RunHealth.check_step and applied_bad_step, steps 1, 2, ...)."""
    import itertools

    from moe_dist.config import load_config
    from moe_dist.train.loop.health import RunHealth

    cfg = load_config(os.path.join(ROOT, "configs", "test.yaml"), ["model.vocab_size=512", *(f"train.{k}={v}" for k, v in train.items())])
    health, steps = RunHealth(cfg, run_dir="", is_main=False, log=lambda msg: None), itertools.count(1)
    return health, lambda row: health.check_step(next(steps), row)


def _step(t, check, loss, grad_norm, skipped=False):
    row = {"loss": loss, "aux_loss": 0.0, "grad_norm": grad_norm}
    if skipped:
        row["skipped"] = True
    return check(row)


def test_bad_steps_add_up_within_the_window_and_applied_ones_count():
    """Every other step bad (skipped), 5 of them within 20 steps: a divergence from the first one; the
    same with a window of 4 never adds up. A gradient norm 10x the recent median, a zero gradient and a
    loss back at ln(vocab) after a median below 0.9 ln(vocab) are bad although applied."""
    t, check = _health(max_nonfinite_steps=5, bad_step_window=20)
    got = [_step(t, check, 5.0, 1.0, skipped=(i % 2 == 0)) for i in range(10)]
    assert got[:8] == [None] * 8 and got[8] is not None, got
    assert (got[8].first_bad_step, got[8].stopped_at) == (1, 9) and "steps 1, 3, 5, 7, 9 were bad" in got[8].why
    t, check = _health(max_nonfinite_steps=3, bad_step_window=4)
    assert [_step(t, check, 5.0, 1.0, skipped=(i % 3 == 0)) for i in range(30)] == [None] * 30
    uniform = math.log(512)
    for loss, norm, words in ((4.0, 11.0, "spiked over train.grad_spike_factor=10"), (4.0, 0.0, "exactly 0"),
                              (uniform, 1.0, "back at ln(vocab)")):
        t, check = _health()
        for _ in range(3):
            assert _step(t, check, 4.0, 1.0) is None
        assert _step(t, check, loss, norm) is None and t.bad_steps == deque([4]), (words, t.bad_steps)
        assert words in t.applied_bad_step({"loss": loss, "grad_norm": norm}), words
        assert list(t.recent_losses) == [4.0] * 3  # not counted healthy
    t, check = _health(grad_spike_factor="null", detect_collapse="false")
    for loss, norm in ((4.0, 1.0), (4.0, 1.0), (4.0, 1.0), (uniform, 0.0), (4.0, 50.0)):
        assert _step(t, check, loss, norm) is None
    assert not t.bad_steps


def test_a_loss_passing_ln_vocab_on_its_way_down_is_no_collapse():
    """One bad update sends the loss above ln(vocab); the following steps fall back through it by more
    than 1% a step: only the jump is a bad step, no divergence. A loss that stays at ln(vocab) is a
    collapse every step, and its divergence is caught."""
    uniform = math.log(512)
    t, check = _health(max_nonfinite_steps=3, bad_step_window=20)
    for _ in range(5):
        assert _step(t, check, 4.0, 1.0) is None
    for loss in (1.28 * uniform, 1.21 * uniform, 1.16 * uniform, 1.12 * uniform, 1.05 * uniform, 0.99 * uniform,
                 0.95 * uniform, 0.9 * uniform):
        assert _step(t, check, loss, 1.0) is None
    assert list(t.bad_steps) == [6], t.bad_steps
    t, check = _health(max_nonfinite_steps=3, bad_step_window=20)
    for _ in range(5):
        assert _step(t, check, 4.0, 1.0) is None
    got = [_step(t, check, loss, 1.0) for loss in (uniform, 1.001 * uniform, 0.999 * uniform)]
    assert got[:2] == [None, None] and got[2] is not None and "steps 6, 7, 8 were bad" in got[2].why, got
    assert list(t.bad_steps) == [6, 7, 8] and "the model collapsed" in t.applied_bad_step({"loss": uniform,
                                                                                          "grad_norm": 1.0})


def test_a_run_recovering_from_one_large_step_is_not_stopped(tmp_path):
    """The reported case: 20 steps, one step at train.lr=3, then the run continues at its rate: the loss
    passes back through ln(vocab) on its way down and the run ends normally (it was stopped at step 26
    for 'steps 22-26 were bad' while its loss fell every step)."""
    run = tmp_path / "run"
    common = ["train.global_batch=8", "eval.every=0"]
    for extra in (["train.steps=20"], ["train.steps=21", "resume=auto", "train.lr=3"],
                  ["train.steps=40", "resume=auto"]):
        code, out, err = train(tmp_path, run, *common, *extra)
        assert code == 0, out + err
    losses = {r["step"]: r["loss"] for r in rows(run) if "loss" in r}
    assert losses[22] > math.log(512) and losses[40] < 0.9 * math.log(512), losses
    assert len([r for r in rows(run) if r.get("bad")]) < 5
