"""``moe-dist plan`` recommends a command ``train`` accepts, and its dry run gives a verdict.

- the batch rule is one function (:mod:`moe_dist.config.batch`) that the trainer's config check
  refuses with and the planner adjusts with;
- the command ``plan`` prints for a cluster where the preset's batch settings are refused (the
  Phi-3 preset on 8 nodes of 8 GPUs: 16 sequences per forward on 64 ranks) passes the trainer's
  config check at that world size, and the dry-run command it prints runs and says it fits;
- the dry run's verdict against ``--gpu-mem-gib`` sets the exit status (0 fits, 3 does not);
- an impossible ``--routing skew:F`` is refused with the allowed range;
- the dry run does not time this CPU's bf16 matmuls (a GPU job's plan has no use for that).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from moe_dist.config import load_config
from moe_dist.config.batch import batch_problems, nearest_valid_batches
from moe_dist.errors import ConfigError
from moe_dist.plan import format_plan, plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHI3 = "configs/phi3-mini-upcycle-4x2.yaml"
TINY = ["model.n_layers=2", "train.seq_len=64", "model.vocab_size=4096", "eval.batch=16"]


def _cli(command: str) -> subprocess.CompletedProcess:
    """A ``moe-dist ...`` line as printed, run with this interpreter from the repository root."""
    words = shlex.split(command)
    assert words[0] == "moe-dist", command
    return subprocess.run([sys.executable, "-m", "moe_dist.cli", *words[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)


def test_the_batch_rule_adjusts_to_the_nearest_accepted_values():
    assert batch_problems(64, 4, 16, 64) and not batch_problems(64, 1, 64, 64)
    # the global batch kept with fewer micro-batches when it has a sequence per rank
    assert nearest_valid_batches(64, 4, 16, 64) == {"train.grad_accum": 1, "eval.batch": 64}
    assert nearest_valid_batches(96, 4, 64, 32) == {"train.grad_accum": 3}  # 96 / 3 = 32 per forward
    # else raised to one sequence per rank, one micro-batch
    assert nearest_valid_batches(12, 2, 32, 64) == {"train.global_batch": 64, "train.grad_accum": 1, "eval.batch": 64}
    assert nearest_valid_batches(128, 2, 64, 64) == {}
    for args in [(64, 4, 16, 64), (96, 4, 64, 32), (12, 2, 32, 64), (7, 7, 1, 3)]:
        changed = {"train.global_batch": args[0], "train.grad_accum": args[1], "eval.batch": args[2]}
        changed.update(nearest_valid_batches(*args))
        assert changed["train.global_batch"] % changed["train.grad_accum"] == 0
        assert not batch_problems(changed["train.global_batch"], changed["train.grad_accum"], changed["eval.batch"],
                                  args[3]), args


def test_the_trainer_refuses_with_the_same_rule():
    cfg = load_config(os.path.join(ROOT, PHI3))
    with pytest.raises(ConfigError, match=r"train.global_batch: global_batch / grad_accum = 16 sequences per forward"):
        cfg.check_world(64)
    key, why = batch_problems(64, 4, 16, 64)[0]
    with pytest.raises(ConfigError) as refused:
        cfg.check_world(64)
    assert str(refused.value) == f"{key}: {why}"


def test_the_recommended_command_is_accepted_at_that_world_size():
    p = plan(os.path.join(ROOT, PHI3), 8, 8, 80)
    assert p["recommended"] is not None
    assert p["batch_changes"] == {"train.grad_accum": [4, 1], "eval.batch": [16, 64]}
    overrides = p["command"]["overrides"]
    assert f"parallel.ep={p['recommended']['ep']}" in overrides and "train.grad_accum=1" in overrides
    load_config(os.path.join(ROOT, PHI3), overrides).check_world(64)  # the trainer's check passes
    assert p["workload"]["grad_accum"] == 1  # the layouts were planned for the command's settings
    text = format_plan(p)
    rec = next(line for line in text.splitlines() if line.startswith("recommended:"))
    assert "train.grad_accum=1 eval.batch=64" in rec
    assert "train.grad_accum 4 -> 1, eval.batch 16 -> 64" in text
    assert "72.0 usable: 10% kept for" in text and "ZeRO stages, for comparison" in text
    assert f"command: moe-dist train --config {os.path.join(ROOT, PHI3)} " in text and " --dry-run " in text
    # a batch below one sequence per rank is raised; --micro-batch sets the global batch
    tiny = plan(os.path.join(ROOT, "configs", "tiny.yaml"), 8, 8, 80)
    assert tiny["batch_changes"]["train.global_batch"] == [12, 64]
    load_config(os.path.join(ROOT, "configs", "tiny.yaml"), tiny["command"]["overrides"]).check_world(64)
    two = plan(os.path.join(ROOT, "configs", "tiny.yaml"), 1, 4, 80, micro_batch=2)
    assert two["batch_changes"]["train.global_batch"] == [12, 2 * 4 * 1]
    assert two["workload"]["micro_batch_per_gpu"] == 2
    # a Hugging Face config has no batch settings: overrides for the config upcycle writes
    hf = plan(os.path.join(ROOT, "configs", "hf", "mixtral-8x7b.json"), 2, 8, 80)
    assert hf["batch_changes"] == {} and hf["command"]["train"] is None and hf["command"]["dry_run"]
    per_rank = plan(os.path.join(ROOT, "configs", "hf", "mixtral-8x7b.json"), 2, 8, 80, micro_batch=2)
    assert " --micro-batch 2 --dry-run " in per_rank["command"]["dry_run"]  # the planned batch, for the dry run


def test_the_recommended_dry_run_runs_and_fits():
    """The dry-run line the plan prints, run as printed: one rank of 64 of the Phi-3 preset (two
    blocks, to keep it short) with the adjusted batch settings, exit 0 and the verdict."""
    p = plan(os.path.join(ROOT, PHI3), 8, 8, 80, ["model.n_layers=2"])
    done = _cli(p["command"]["dry_run"])
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "rank 0 of 64" in done.stdout and "verdict: fits with " in done.stdout, done.stdout[-2000:]
    assert "bf16" in done.stdout.splitlines()[0]  # the preset's dtype, as a GPU runs it


def test_the_verdict_sets_the_exit_status():
    from moe_dist.plan.dry_run_report import DOES_NOT_FIT, verdict

    gib = 1 << 30
    fits = verdict(int(30 * gib), 40)
    assert fits["fits"] and fits["spare_gib"] == pytest.approx(6.0) and "fits with 6.00 GiB to spare" in fits["line"]
    short = verdict(int(47.6 * gib), 40)
    assert not short["fits"] and "does not fit by 11.60 GiB" in short["line"] and "36.00 usable" in short["line"]
    base = ["plan", "--config", "configs/tiny.yaml", "--nodes", "1", "--gpus-per-node", "4", "--dry-run", *TINY]
    small = subprocess.run([sys.executable, "-m", "moe_dist.cli", *base, "--gpu-mem-gib", "0.01"], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert small.returncode == DOES_NOT_FIT, small.stdout[-2000:] + small.stderr[-2000:]
    assert "verdict: does not fit by " in small.stdout


def test_an_impossible_skew_is_refused_with_the_allowed_range(capsys):
    from moe_dist.cli import main as cli
    from moe_dist.plan.dry_run import dry_run

    four = TINY + ["model.moe.num_experts=4", "model.moe.top_k=2", "parallel.ep=2"]
    with pytest.raises(ConfigError, match=r"--routing: skew:3.5; allowed: skew:F with 1 <= F <= 2 \(4 experts, "
                                          r"top-2: .*experts / top_k = 2x the mean\)"):
        dry_run("configs/tiny.yaml", four, nodes=1, gpus_per_node=2, routing="skew:3.5")
    assert cli(["plan", "--config", "configs/tiny.yaml", "--nodes", "1", "--gpus-per-node", "2", "--dry-run",
                "--routing", "skew:3.5", *four]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--routing: skew:3.5; allowed: skew:F with 1 <= F <= 2" in err[0], err


def test_the_dry_run_does_not_probe_this_cpu(monkeypatch, capsys):
    """A bf16 config's dry run keeps bf16 without timing a matmul here (the trainer's runtime would)."""
    import moe_dist.tuning.bf16 as bf16
    from moe_dist.plan.dry_run import dry_run

    def no_probe(*args, **kwargs):
        raise AssertionError("the dry run timed this CPU's bf16 matmuls")

    monkeypatch.setattr(bf16, "bf16_matmul_slowdown", no_probe)
    result = dry_run("configs/tiny.yaml", TINY + ["train.dtype=bf16", "train.global_batch=4"], nodes=1, gpus_per_node=2)
    assert result["layout"]["dtype"] == "bf16"
    assert "bf16" not in capsys.readouterr().out
