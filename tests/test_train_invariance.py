"""Same global batch and seed on 1, 2 and 4 gloo ranks (expert-parallel 1, 2, 4, and 2 with
4 ranks) give the same loss curve, gradient norms and auxiliary losses; a checkpoint written
by 2 ranks at ep=2 evaluates identically on one process at ep=1."""
import os

import pytest
import torch

from helpers import probe_router  # noqa: F401  (registers the _test_probe router, also in spawned ranks)
from helpers.dist_harness import run_ranks
from moe_dist.config import load_config
from moe_dist.train.evaluation.saved import evaluate_run
from moe_dist.train.loop.trainer import Trainer, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
CASES = {
    # FSDP2 for dense weights, 2 micro-batches per step, activation checkpointing, topk router
    "fsdp-accum-ckpt": ["train.grad_accum=2", "train.activation_checkpointing=true"],
    # replicated dense weights, one micro-batch per step, and a router that asks for attention
    # probabilities and records the context the trainer gives it
    "replicate-probe": ["parallel.dense=replicate", "model.moe.router=_test_probe"],
}


def config(tmp, name, *extra):
    return load_config(os.path.join(ROOT, "configs/test.yaml"), [
        f"run.dir={tmp}/{name}", f"data.cache_dir={tmp}/cache", f"data.corpus={ROOT}/tests/data/python-docs",
        "run.tensorboard=false", "run.plots=false", "ckpt.save_final=false", f"train.steps={STEPS}",
        "train.lr=0.003", *extra])


def curve(cfg):
    trainer = Trainer(cfg)
    try:
        rows = [trainer.train_step() for _ in range(cfg.train.steps)]
        probes = [{"optimizer_steps": list(m.router.optimizer_steps),
                   "micro_steps": [s["micro_step"] for s in m.router.seen], "steps": [s["step"] for s in m.router.seen],
                   "seeds": {s["seed"] for s in m.router.seen}, "shapes": {s["batch_shape"] for s in m.router.seen}}
                  for m in trainer.moe if hasattr(m.router, "seen")]
        return {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows],
                "aux": [r["aux_loss"] for r in rows], "probes": probes, "world": trainer.rt.world_size}
    finally:
        trainer.close()


def _ranks(rank, world, tmp, ep, with_checkpoint):
    out = {name: curve(config(tmp, f"{name}-{world}-{ep}", f"parallel.ep={ep}", *ov)) for name, ov in CASES.items()}
    if with_checkpoint:
        cfg = config(tmp, "ckpt", "parallel.ep=2", "ckpt.save_final=true", "train.steps=2")
        out["ckpt_val_loss"] = train(cfg)["val_loss"]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("invariance")
    return tmp, {name: curve(config(tmp, f"{name}-1", "parallel.ep=1", *ov)) for name, ov in CASES.items()}


def check_same(ref, got, what):
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(ref["loss"]), rtol=1e-5, atol=0,
                               msg=lambda m: f"{what} loss: {m}")
    torch.testing.assert_close(torch.tensor(got["grad_norm"]), torch.tensor(ref["grad_norm"]), rtol=2e-4, atol=0,
                               msg=lambda m: f"{what} grad norm: {m}")
    torch.testing.assert_close(torch.tensor(got["aux"]), torch.tensor(ref["aux"]), rtol=1e-4, atol=1e-9,
                               msg=lambda m: f"{what} aux loss: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 4), (4, 2)])
def test_loss_curve_does_not_depend_on_the_layout(reference, world, ep):
    tmp, ref = reference
    assert ref["fsdp-accum-ckpt"]["loss"][-1] < ref["fsdp-accum-ckpt"]["loss"][0]  # it trains
    results = run_ranks(_ranks, world, args=(str(tmp), ep, world == 2), timeout=300)
    for rank, res in enumerate(results):
        for name in CASES:
            assert res[name]["world"] == world
            check_same(ref[name], res[name], f"{name} on rank {rank} of {world} (ep={ep})")
        probes = res["replicate-probe"]["probes"]  # the trainer's side of the router contract
        assert len(probes) == 2
        for probe in probes:
            assert probe["optimizer_steps"] == list(range(STEPS))  # after each optimizer step, on every rank
            assert probe["micro_steps"] == [0] * STEPS and probe["steps"] == list(range(STEPS))
            assert probe["seeds"] == {0} and probe["shapes"] == {(8 // world, 64)}
    if world == 2:
        # the checkpoint of a 2-rank ep=2 FSDP run, evaluated by one process at ep=1
        cfg = config(tmp, "ckpt", "parallel.ep=1")
        again = evaluate_run(cfg)
        assert again["step"] == 2
        assert again["val_loss"] == pytest.approx(results[0]["ckpt_val_loss"], rel=1e-6)
