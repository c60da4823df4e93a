"""The real command line: `moe-dist train --nproc 2` end to end (torchrun, 2 gloo ranks,
expert-parallel 2, FSDP2), then `moe-dist eval` of its checkpoint on 1 and 2 processes."""
import json
import os
import subprocess
import sys

import pytest

from moe_dist.cli import main as cli_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def moe_dist(*args, timeout=400):
    script = os.path.join(os.path.dirname(sys.executable), "moe-dist")
    cmd = [script] if os.path.exists(script) else [sys.executable, "-m", "moe_dist.cli"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return subprocess.run(cmd + list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    d = tmp / "run"
    res = moe_dist("train", "--config", "configs/test.yaml", "--nproc", "2", f"run.dir={d}",
                   f"data.cache_dir={tmp}/cache", "run.progress=false")
    assert res.returncode == 0, res.stdout + res.stderr
    return d, res


@pytest.mark.slow
def test_two_rank_train_end_to_end(run_dir):
    d, res = run_dir
    out = res.stdout
    assert out.count("done: 8 steps") == 1  # rank 0 alone reports
    assert "2 process(es) [local, gloo" in out and "ep=2, dense=fsdp" in out
    assert "validation perplexity" in out and "unigram baseline perplexity" in out
    for name in ("config.yaml", "metrics.jsonl", "run.json", "summary.json", "plots/loss.png", "plots/expert_load.png",
                 "checkpoints/step_000008/COMPLETE", "checkpoints/step_000008/meta.json"):
        assert os.path.exists(d / name), name
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(d / "tb"))
    rows = [json.loads(line) for line in open(d / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    assert all(len(r["moe"]["0"]["expert_counts"]) == 4 for r in rows)
    info = json.load(open(d / "run.json"))
    assert (info["world_size"], info["ep"], info["dense"], info["launcher"]) == (2, 2, "fsdp", "local")
    meta = json.load(open(d / "checkpoints/step_000008/meta.json"))
    assert meta["sampler"]["consumed"] == 8 * 8 and meta["ep"] == 2


@pytest.mark.slow
def test_eval_of_the_checkpoint_on_another_layout(run_dir):
    d, _ = run_dir
    summary = json.load(open(d / "summary.json"))
    # as documented: one process, although the run trained with parallel.ep=2 (the checkpoint loads at any ep)
    res = moe_dist("eval", "--run-dir", str(d))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 process(es), ep=1" in res.stdout and "unigram baseline perplexity" in res.stdout
    result = json.load(open(d / "eval.json"))
    assert result["step"] == 8 and (result["world_size"], result["ep"]) == (1, 1)
    assert result["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    assert result["unigram_ppl"] == pytest.approx(summary["unigram_ppl"])
    res = moe_dist("eval", "--run-dir", str(d), "--nproc", "2")  # the run's ep=2 fits 2 processes: kept
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.load(open(d / "eval.json"))
    assert (result["world_size"], result["ep"]) == (2, 2)
    assert result["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    # an ep given on the command line is the user's choice, checked as such
    res = moe_dist("eval", "--run-dir", str(d), "parallel.ep=2")
    assert res.returncode == 2 and res.stderr.splitlines() == [
        "moe-dist eval: error: parallel.ep: 2 must divide the world size 1; allowed on 1 process(es) with "
        "model.moe.num_experts=4: 1 or auto"]


def test_evaluation_ep():
    from moe_dist.train.evaluation.saved import evaluation_ep

    # the training's size where it fits, else the layout rule of a continued training run (auto)
    assert [evaluation_ep(2, w) for w in (1, 2, 3, 4, 6)] == ["auto", 2, "auto", 2, 2]
    assert [evaluation_ep(4, w) for w in (1, 2, 4, 6, 8)] == ["auto", "auto", 4, "auto", 4]
    assert evaluation_ep("auto", 3) == "auto"


def test_errors_are_reported_before_launching(tmp_path, capsys):
    # the real script: the parent checks the config and reports once, without starting ranks
    res = moe_dist("train", "--config", "configs/test.yaml", "--nproc", "2", "parallel.ep=3", f"run.dir={tmp_path}")
    assert res.returncode == 2
    assert res.stderr.strip() == ("moe-dist train: error: parallel.ep: 3 must divide model.moe.num_experts=4; allowed: "
                                  "1, 2, 4 or auto")
    assert not os.path.exists(tmp_path / "config.yaml")
    # the same entry point in-process for the other paths
    config = os.path.join(ROOT, "configs/test.yaml")
    assert cli_main(["train", "--config", config, "--nproc", "4", "parallel.ep=4", "train.global_batch=2"]) == 2
    assert "at least the number of data-parallel ranks (4)" in capsys.readouterr().err
    assert cli_main(["train", "--config", "configs/missing.yaml", "--nproc", "2"]) == 2
    assert "configs/missing.yaml' does not exist" in capsys.readouterr().err
    assert cli_main(["eval", "--run-dir", str(tmp_path), "--nproc", "2"]) == 2
    assert "has no config.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli_main(["bogus"])
    assert info.value.code == 2 and "invalid choice: 'bogus'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["train", "--nproc", "two"])


@pytest.mark.parametrize("layout", [["--nproc", "2"], ["parallel.ep=1"]], ids=["launcher", "one-rank"])
def test_deepspeed_engine_without_deepspeed_is_refused_before_the_run_directory(tmp_path, layout):
    # a DeepSpeed that cannot be imported (what `import deepspeed` gives without it, or a broken install)
    (tmp_path / "fake" / "deepspeed").mkdir(parents=True)
    (tmp_path / "fake" / "deepspeed" / "__init__.py").write_text('raise ImportError("DeepSpeed is broken here")\n')
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fake"), ROOT, env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, "-m", "moe_dist.cli", "train", "--config", "configs/test.yaml", *layout,
                          "train.engine=deepspeed", f"run.dir={run}", f"data.cache_dir={tmp_path / 'cache'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.splitlines() == ["moe-dist train: error: train.engine: 'deepspeed' needs DeepSpeed (pip install -e "
                                       "'.[deepspeed]'): ImportError: DeepSpeed is broken here; allowed without it: "
                                       "'native'"], res.stderr
    assert not run.exists() and not (tmp_path / "cache").exists()
