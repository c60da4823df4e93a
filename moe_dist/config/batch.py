"""The batch sizes a number of data-parallel ranks accepts: one rule, which
:meth:`~moe_dist.config.schema.Config.check_world` applies by refusing a config and ``moe-dist plan``
by adjusting its recommendation to the nearest values the rule accepts.

Every rank reads at least one sequence of every forward and of every evaluation batch (a rank with
none would wait in the collectives of a step it has no data for), so ``train.global_batch /
train.grad_accum`` and ``eval.batch`` must be at least the number of ranks. Plain functions of
numbers (no torch)."""
from __future__ import annotations


def per_forward(global_batch: int, grad_accum: int) -> int:
    """Sequences of one forward over all ranks."""
    return global_batch // grad_accum


def batch_problems(global_batch: int, grad_accum: int, eval_batch: int, world_size: int) -> list[tuple[str, str]]:
    """``(key, why)`` for each batch setting ``world_size`` ranks refuse; empty when all are accepted."""
    out = []
    if per_forward(global_batch, grad_accum) < world_size:
        out.append(("train.global_batch", f"global_batch / grad_accum = {per_forward(global_batch, grad_accum)} "
                    f"sequences per forward must be at least the number of data-parallel ranks ({world_size}); "
                    "raise train.global_batch or lower train.grad_accum"))
    if eval_batch < world_size:
        out.append(("eval.batch", f"{eval_batch} must be at least the number of data-parallel ranks ({world_size})"))
    return out


def nearest_valid_batches(global_batch: int, grad_accum: int, eval_batch: int, world_size: int) -> dict[str, int]:
    """The settings to change (key -> value) so that ``world_size`` ranks accept the config: the
    global batch kept with fewer micro-batches (the largest ``train.grad_accum`` that divides it and
    leaves a sequence per rank) when it is at least the number of ranks, else ``train.global_batch``
    raised to one sequence per rank (``train.grad_accum`` 1); ``eval.batch`` raised to the number
    of ranks. Empty when nothing needs to change."""
    changes: dict[str, int] = {}
    if any(key == "train.global_batch" for key, _ in batch_problems(global_batch, grad_accum, eval_batch, world_size)):
        fewer = [a for a in range(grad_accum, 0, -1)
                 if global_batch % a == 0 and per_forward(global_batch, a) >= world_size]
        if fewer:
            changes["train.grad_accum"] = fewer[0]
        else:
            changes["train.global_batch"] = world_size
            if grad_accum != 1:
                changes["train.grad_accum"] = 1
    if eval_batch < world_size:
        changes["eval.batch"] = world_size
    return changes
