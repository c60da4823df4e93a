"""The command line as a user types it: options and overrides in any order, user errors as one
line before any process starts, internal errors with their traceback, the thread choice."""
import os
import subprocess
import sys
import time

import pytest

from moe_dist import cli
from moe_dist.errors import CheckpointError, ConfigError, MissingInputError, UserError
from moe_dist.commands.common import user_errors
from moe_dist.train.setup.runtime import THREADS_DEFAULTED, thread_choice

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "test.yaml")


@pytest.mark.parametrize("argv, expect", [
    (["train", "--config", "C", "model.moe.router=ssr", "--nproc", "2", "train.steps=10"],
     {"config": "C", "nproc": 2, "overrides": ["model.moe.router=ssr", "train.steps=10"]}),
    (["train", "a=1", "--print-config", "b=2", "--config", "C"],
     {"config": "C", "print_config": True, "overrides": ["a=1", "b=2"]}),
    (["eval", "a=1", "--run-dir", "D", "--k", "1,2", "b=2", "--nproc", "2"],
     {"run_dir": "D", "k": "1,2", "nproc": 2, "overrides": ["a=1", "b=2"]}),
    (["upcycle", "x=1", "--dense", "D", "--out", "O", "y=2", "--seed", "3"],
     {"dense": "D", "out": "O", "seed": 3, "overrides": ["x=1", "y=2"]}),
    (["export", "x=1", "--checkpoint", "K", "--out", "O"], {"checkpoint": "K", "overrides": ["x=1"]}),
    (["plan", "a=1", "--config", "c", "--json", "b=2", "--nodes", "2"],
     {"config": "c", "json": True, "nodes": 2, "overrides": ["a=1", "b=2"]}),
    (["convert", "--out", "O", "--checkpoint", "K", "--force"], {"checkpoint": "K", "out": "O", "force": True}),
])
def test_options_and_overrides_in_any_order(argv, expect):
    args = cli.parse_args(cli.build_parser(), argv)
    assert args.command == argv[0]
    assert {k: getattr(args, k) for k in expect} == expect


def test_unknown_option_is_refused_once(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--config", CONFIG, "--bogus", "train.steps=1"])
    assert e.value.code == 2
    assert "moe-dist train: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_user_error_is_one_line_and_exit_2(capsys):
    for error in (ConfigError("train.steps: 0 is too small"), MissingInputError("data.corpus='x' does not exist"),
                  CheckpointError("checkpoint x is of another model")):
        def fail(error=error):
            raise error
        assert user_errors("train", fail) == 2
        assert capsys.readouterr().err == f"moe-dist train: error: {error}\n"
    assert issubclass(MissingInputError, FileNotFoundError) and issubclass(UserError, ValueError)


def test_internal_value_error_keeps_its_traceback(monkeypatch, tmp_path, capsys):
    """A ValueError that is not a UserError is a bug: the command ends with exit code 1 and its
    traceback, not with the one-line message and exit code 2 of a user error."""
    import moe_dist.train.loop.trainer as trainer

    def broken(cfg, rt=None):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(trainer, "train", broken)
    assert cli.main(["train", "--config", CONFIG, f"run.dir={tmp_path}"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in broken" in err
    assert err.rstrip().endswith("ValueError: an internal invariant broke") and "error: an internal" not in err
    # and through the real entry point: a traceback, not the one-line form
    code = ("import sys, moe_dist.train.loop.trainer as t\n"
            "def broken(cfg, rt=None):\n    raise ValueError('an internal invariant broke')\n"
            "t.train = broken\nfrom moe_dist.cli import main\n"
            f"sys.exit(main(['train', '--config', {CONFIG!r}, 'run.dir={tmp_path}']))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert "Traceback (most recent call last)" in res.stderr
    assert res.stderr.rstrip().endswith("ValueError: an internal invariant broke")
    assert "moe-dist train: error:" not in res.stderr


def _moe_dist(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "moe_dist.cli", *args], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    return res, time.perf_counter() - t0


@pytest.mark.parametrize("override, message", [
    ("resume=bogus", "resume: 'bogus' is not a directory; allowed: auto, none, a checkpoint directory"),
    ("model.moe.router_options.p=3", "model.moe.router_options.p must be in [0, 1], got 3.0"),
    ("data.corpus=/nonexistent/corpus", "data.corpus='/nonexistent/corpus' does not exist"),
])
def test_bad_values_are_refused_before_launch(tmp_path, override, message):
    run_dir = tmp_path / "run"
    res, _ = _moe_dist("train", "--config", "configs/test.yaml", "model.moe.router=ssr", "--nproc", "2",
                             override, f"run.dir={run_dir}")
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.startswith("moe-dist train: error: " + message) and res.stderr.count("\n") == 1, res.stderr
    assert res.stdout == "" and not run_dir.exists()  # no rank started: torchrun never ran


def test_router_option_of_a_wrong_type_is_one_line(tmp_path):
    """A router option that cannot be what its router declares (a number here) ends as one line
    naming the key and what is allowed, not as a TypeError inside the router."""
    run_dir = tmp_path / "run"
    res, _ = _moe_dist("train", "--config", "configs/tiny.yaml", "model.moe.router=ssr", "model.moe.router_options.p=abc",
                       f"run.dir={run_dir}")
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr == "moe-dist train: error: model.moe.router_options.p: got 'abc' (str); allowed: a number\n"
    assert res.stdout == "" and not run_dir.exists()


def test_thread_choice():
    env = {"OMP_NUM_THREADS": "3"}
    assert thread_choice(5, 2, env) == (5, "run.threads")  # run.threads wins
    assert thread_choice(None, 2, env) == (3, "OMP_NUM_THREADS")  # then the user's OMP_NUM_THREADS
    n, why = thread_choice(None, 1, {})
    cores = len(os.sched_getaffinity(0))
    assert (n, why) == (cores, f"{cores} core(s) / 1 local process(es)")
    # the value `moe-dist --nproc` sets when the user had none is the default, reported as such
    assert thread_choice(None, 1, {**env, THREADS_DEFAULTED: "1"})[1].endswith("local process(es)")
    assert thread_choice(None, 1, {"OMP_NUM_THREADS": "0"})[1].endswith("local process(es)")


def test_thread_choice_is_applied_and_printed(tmp_path):
    """A one-process run with OMP_NUM_THREADS=1 uses 1 thread and says why."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-m", "moe_dist.cli", "train", "--config", "configs/test.yaml",
                          f"run.dir={tmp_path}/run", f"data.cache_dir={tmp_path}/cache", "train.steps=1",
                          "run.progress=false", "run.plots=false", "ckpt.save_final=false", "parallel.ep=1",
                          "run.threads=null"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 thread(s) each from OMP_NUM_THREADS" in res.stdout


def _collective_errors(rank, world):
    """What each rank raises when one rank's step of a checkpoint load fails."""
    from moe_dist.train.checkpoint.collective import collectively

    out = {}
    for kind, error in (("internal", KeyError("a bug")), ("user", CheckpointError("checkpoint x is damaged"))):
        def step(error=error):
            if rank == 1:
                raise error
            return "fine"
        try:
            collectively(step, None)
            out[kind] = None
        except Exception as e:  # noqa: BLE001 - the test looks at the type
            out[kind] = (type(e).__name__, str(e))
    return out


def test_checkpoint_collective_keeps_internal_errors_internal():
    """A refusal (CheckpointError) reaches every rank as a CheckpointError, the one-line user error;
    a bug on one rank stays itself there and is a RuntimeError naming that rank on the others,
    so neither is mistaken for a user error."""
    from helpers.dist_harness import run_ranks

    r0, r1 = run_ranks(_collective_errors, 2, timeout=60)
    assert r1 == {"internal": ("KeyError", "'a bug'"), "user": ("CheckpointError", "checkpoint x is damaged")}
    assert r0["internal"] == ("RuntimeError", "rank 1 of the checkpoint group failed: KeyError: 'a bug'")
    assert r0["user"] == ("CheckpointError", "checkpoint x is damaged")
