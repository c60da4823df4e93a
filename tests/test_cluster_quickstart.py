"""docs/cluster-quickstart.md's commands, as bash runs them.

The page's ``bash`` blocks run in a real bash in which the cluster's own tools (``srun``, ``sbatch``,
``enroot``, ``tensorboard``) only record the arguments bash hands them: what each would be asked
to run. The default checks then hold every ``moe-dist`` command to the CLI's parser and every
config change to the schema, and the job's settings (the upcycle's overrides, then the
submission's) to the rules the trainer applies at 64 GPUs and at the node counts the page resumes
on. This checks the page, not Slurm: the batch script itself is tested on the test Slurm cluster
(tests/test_launch_slurm.py, tests/test_multinode_slurm.py).

With ``MOE_DIST_QUICKSTART=1`` (opt-in: a few minutes on 2 cores) the ``moe-dist`` commands run for
real, in order, on a tiny dense Llama instead of the 7B model and on the test corpus: upcycle, plan,
dry run, a 2-rank training run for the submission, a 1-rank resume for the other node count, export.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from moe_dist.cli import build_parser, parse_args
from moe_dist.config import load_config
from helpers.quickstart import ROOT, page_paths, page_script, substitute, tiny_dense

TOOLS = ("srun", "sbatch", "enroot", "tensorboard")
FIELD, RECORD = "\x1f", "\x1e"


def recorded_calls(tmp_path: Path) -> list[dict]:
    """Run the page in bash with the cluster's tools recording their arguments (and the
    environment variables the batch script reads); the page's ``grep`` reads a job log that holds one
    ``[launch]`` line."""
    rec = tmp_path / "calls"
    stubs = "".join(f"{tool}() {{ printf '%s{FIELD}' {tool} \"MOE_DIST_CONTAINER_IMAGE=${{MOE_DIST_CONTAINER_IMAGE-}}\" "
                    f"\"PYTHON=${{PYTHON-}}\" \"$@\" >>{shlex.quote(str(rec))}; printf '{RECORD}' >>{shlex.quote(str(rec))}; }}\n"
                    for tool in TOOLS)
    (tmp_path / "moe-dist-JOBID.out").write_text("[launch] lost node(s): node3; 7 node(s) left\n")
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", stubs + "cd " + shlex.quote(str(tmp_path)) + "\n"
                          + page_script()], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    calls = []
    for raw in rec.read_text().split(RECORD)[:-1]:
        tool, image, python, *argv = raw.split(FIELD)[:-1]
        calls.append({"tool": tool, "image": image.split("=", 1)[1], "python": python.split("=", 1)[1],
                      "argv": argv})
    assert calls, res.stderr
    return calls


def moe_dist_argv(call: dict) -> list[str]:
    """The ``moe-dist`` command an ``srun`` call runs (its arguments after ``moe-dist``)."""
    argv = call["argv"]
    assert "moe-dist" in argv, f"srun runs no moe-dist command: {argv}"
    return argv[argv.index("moe-dist") + 1:]


def sbatch_job(call: dict) -> tuple[int, str, list[str]]:
    """``(nodes x tasks per node, config, overrides)`` of an ``sbatch`` call of the batch script."""
    argv = call["argv"]
    script = next(i for i, a in enumerate(argv) if a.endswith(".sbatch"))
    assert (ROOT / argv[script]).is_file(), argv[script]
    opts = dict(re.match(r"--([\w-]+)=(.*)", a).groups() for a in argv[:script] if a.startswith("--"))
    nodes = int(argv[argv.index("-N") + 1])
    return nodes * int(opts["ntasks-per-node"]), argv[script + 1], argv[script + 2:]


def test_every_command_is_accepted(tmp_path):
    calls = recorded_calls(tmp_path)
    tools = [c["tool"] for c in calls]
    assert tools.count("sbatch") == 2 and "enroot" in tools and "tensorboard" in tools, tools
    for call in (c for c in calls if c["tool"] == "srun"):
        argv = moe_dist_argv(call)
        assert "--container-image=" in " ".join(call["argv"]), call["argv"]
        args = parse_args(build_parser(argv[0]), argv)  # the CLI's own parser: options and overrides
        load_config(None, args.overrides)  # every KEY=VALUE a key of the schema with an allowed value
    for call in (c for c in calls if c["tool"] == "sbatch"):
        assert call["image"].endswith(".sqsh") and not call["python"], call  # the ranks in the container


def test_the_job_fits_the_rules_at_every_node_count(tmp_path):
    """The upcycle's settings plus the submission's overrides pass the trainer's checks at 64 GPUs
    and at the node count of the resume (the batch sizes against the ranks, parallel.ep)."""
    calls = recorded_calls(tmp_path)
    upcycle = next(moe_dist_argv(c) for c in calls if c["tool"] == "srun" and moe_dist_argv(c)[0] == "upcycle")
    written = [a for a in upcycle if "=" in a and not a.startswith("-")]
    for call in (c for c in calls if c["tool"] == "sbatch"):
        world, _, overrides = sbatch_job(call)
        cfg = load_config(None, written + overrides)
        hosts = [f"node{r // 8}" for r in range(world)]
        if cfg.parallel.ep == "auto":
            cfg.parallel.ep = cfg.expert_parallel_size(hosts)
        cfg.check_world(world)  # raises ConfigError naming the key, as the trainer would


def _substitute(argv: list[str], paths: dict[str, str]) -> list[str]:
    return [substitute(a, paths) for a in argv]


def _moe_dist(argv: list[str], cwd: Path) -> str:
    res = subprocess.run([sys.executable, "-m", "moe_dist.cli", *argv], cwd=cwd, capture_output=True, text=True,
                         timeout=900, env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert res.returncode == 0, f"moe-dist {' '.join(argv)}\n{res.stdout}\n{res.stderr}"
    return res.stdout + res.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MOE_DIST_QUICKSTART") != "1",
                    reason="opt-in: MOE_DIST_QUICKSTART=1 (the page's moe-dist commands on a tiny model, minutes)")
def test_the_moe_dist_commands_run_on_a_tiny_model(tmp_path):
    calls = recorded_calls(tmp_path)
    paths = page_paths(tiny_dense(tmp_path / "dense"), tmp_path)
    tiny = ["train.seq_len=32", "train.steps=4", "eval.max_sequences=64", "data.val_fraction=0.2"]
    upcycle = up = None
    for call in calls:
        if call["tool"] == "srun":
            argv = _substitute(moe_dist_argv(call), paths)
            if argv[0] == "upcycle":
                upcycle, up = argv, argv[argv.index("--out") + 1]
                _moe_dist(argv + tiny, tmp_path)
            elif argv[0] == "plan":
                out = _moe_dist(argv, tmp_path)
                assert ("dry run of" in out) if "--dry-run" in argv else ("recommended:" in out), out
            else:  # export: the latest checkpoint of the run as a Hugging Face checkpoint
                _moe_dist(argv, tmp_path)
                assert (Path(argv[argv.index("--out") + 1]) / "config.json").is_file()
        elif call["tool"] == "sbatch":  # the job, as 2 local ranks the first time and 1 after
            _, config, overrides = sbatch_job(call)
            first = not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("COMPLETE"))
            nproc = "2" if first else "1"
            steps = ["ckpt.every=2"] + ([] if first else ["train.steps=6"])
            out = _moe_dist(["train", "--config", _substitute([config], paths)[0], "--nproc", nproc, "resume=auto",
                             *_substitute(overrides, paths), *steps], tmp_path)
            assert first or "resumed from" in out, out
    assert upcycle and up
