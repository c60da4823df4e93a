"""A run of configs/test.yaml whose loss is poisoned once, at the 6th call of the loss function
the trainer uses (step 6): ``nan`` makes it NaN, ``spike`` 10 times larger (finite). Prints the
summary as JSON. Defaults: a checkpoint every 2 steps, train.max_nonfinite_steps=1,
train.on_divergence=rollback (the overrides may change them).

    python tests/helpers/divergence_case.py RUN_DIR CACHE_DIR nan|spike [KEY=VALUE ...]
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from moe_dist.config import load_config  # noqa: E402
from moe_dist.train.loop import step as step_module  # noqa: E402
from moe_dist.train.loop import trainer as trainer_module  # noqa: E402

real = step_module.F


class PoisonedOnce:
    """torch.nn.functional, but the 6th cross_entropy is multiplied by ``factor``."""

    calls, factor = 0, float("nan")

    def __getattr__(self, name):
        return getattr(real, name)

    def cross_entropy(self, *args, **kwargs):
        PoisonedOnce.calls += 1
        loss = real.cross_entropy(*args, **kwargs)
        return loss * PoisonedOnce.factor if PoisonedOnce.calls == 6 else loss


if __name__ == "__main__":
    run, cache, poison, *extra = sys.argv[1:]
    PoisonedOnce.factor = {"nan": float("nan"), "spike": 10.0}[poison]
    step_module.F = PoisonedOnce()  # the training step's loss (moe_dist/train/loop/step.py)
    cfg = load_config(os.path.join(ROOT, "configs/test.yaml"), [
        f"run.dir={run}", f"data.cache_dir={cache}", "parallel.ep=1", "run.progress=false", "run.plots=false",
        "run.tensorboard=false", "ckpt.every=2", "train.max_nonfinite_steps=1", "train.on_divergence=rollback",
        *extra])
    summary = trainer_module.train(cfg)
    print("SUMMARY " + json.dumps({k: summary[k] for k in ("steps", "rollbacks", "skipped_steps")}))
