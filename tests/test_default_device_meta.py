"""GPU readiness on a CPU: whole training steps with ``torch.set_default_device("meta")`` in force.

Code that creates a tensor without saying where (``torch.zeros(n)`` beside a CUDA activation)
works on a CPU-only machine and fails on the first GPU run. With the default device set to
``meta``, every such tensor becomes a meta tensor and fails at its first use next to real ones,
so these runs fail wherever the code relies on the default device: model initialisation,
routing, the expert-parallel exchange (overlapped), capacity and dropless dispatch, shared
experts, expert bias, the sequence loss, activation checkpointing, the collectives of the
statistics and of the gradients, the optimizer step, checkpoint save and resume.
Each case: 2 ranks (ep=2) train 2 steps and save; the routers with state (and the first case)
then resume and train 1 more step. Under the marker ``compile``, the same for a run with
``train.compile`` (capacity, shared expert, activation checkpointing, resume).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers.dist_harness import run_ranks
from helpers.router_cases import ROUTER_OVERRIDES

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = {
    "topk-capacity-bias-seqloss-ac": ["model.moe.capacity_factor=1.0", "model.moe.expert_bias=true",
                                      "model.moe.balance_loss=sequence", "train.activation_checkpointing=true"],
    "topk-dropless-shared": ["model.moe.capacity_factor=null", "model.moe.shared_d_ff=32"],
    **ROUTER_OVERRIDES,
}


# train.compile (marker `compile`: compiling takes a minute or more on 2 cores): the compiled parts of the
# blocks, and inductor's own tensors, with the default device on meta
COMPILE_CASES = {
    "compiled-topk-capacity-shared-ac": ["train.compile=true", "model.moe.capacity_factor=1.0",
                                         "model.moe.shared_d_ff=32", "train.activation_checkpointing=true"],
}
ALL_CASES = {**CASES, **COMPILE_CASES}
RESUMED = {"topk-capacity-bias-seqloss-ac", "ssr", "ac", "symphony", "hyper",  # router state through a checkpoint
           "compiled-topk-capacity-shared-ac"}


def _train_on_meta_default(rank, world, tmp, names=tuple(CASES)):
    """Every case in one pair of processes (one start-up): losses per case, or the case's error."""
    import traceback

    from moe_dist.config import load_config
    from moe_dist.train.loop.trainer import train

    def cfg(name, *more):
        return load_config(os.path.join(ROOT, "configs", "test.yaml"), [
            f"run.dir={tmp}/{name}", f"data.cache_dir={tmp}/cache", f"data.corpus={ROOT}/tests/data/python-docs",
            "parallel.ep=2", "run.tensorboard=false", "run.plots=false", "run.progress=false", "eval.max_sequences=8",
            "eval.probe_every=1", *ALL_CASES[name], *more])

    out = {}
    for name in names:
        torch.set_default_device("meta")
        try:
            train(cfg(name, "train.steps=2"))
            if name in RESUMED:
                train(cfg(name, "train.steps=3", "resume=auto"))
        except Exception:  # noqa: BLE001 - reported per case
            out[name] = traceback.format_exc()
            continue
        finally:
            torch.set_default_device("cpu")
        with open(os.path.join(tmp, name, "metrics.jsonl")) as f:
            out[name] = [r["loss"] for r in map(json.loads, f) if r.get("loss") is not None]
    return out


def test_training_runs_with_the_default_device_on_meta(tmp_path):
    check(run_ranks(_train_on_meta_default, 2, args=(str(tmp_path),), timeout=900)[0])


@pytest.mark.compile
@pytest.mark.timeout(1800)
def test_compiled_training_runs_with_the_default_device_on_meta(tmp_path):
    check(run_ranks(_train_on_meta_default, 2, args=(str(tmp_path), tuple(COMPILE_CASES)), timeout=1200)[0])


def check(out: dict) -> None:
    failed = {name: result for name, result in out.items() if isinstance(result, str)}
    assert not failed, "\n\n".join(f"{name}:\n{tb}" for name, tb in failed.items())
    for name, losses in out.items():
        assert len(losses) == (3 if name in RESUMED else 2), (name, losses)
        assert all(l == l and l < 20 for l in losses), (name, losses)
