"""What ``moe-dist plan`` recommends as a command: the overrides that select its layout, with the
batch settings the trainer accepts at that world size, and the dry run that checks it.

The batch rule is the trainer's own (:mod:`moe_dist.config.batch`): where the config's
``train.global_batch`` / ``train.grad_accum`` / ``eval.batch`` would be refused at the planned
number of ranks, the plan is made for the nearest accepted values, and the recommendation names
them, so that the line it prints is a command ``train`` runs."""
from __future__ import annotations

import shlex
from dataclasses import replace
from typing import Iterable, Optional

from ..config.batch import nearest_valid_batches
from .plan_input import PlanInput

_FIELDS = {"train.global_batch": "global_batch", "train.grad_accum": "grad_accum", "eval.batch": "eval_batch"}


def batch_settings(inp: PlanInput, world: int, micro_batch: Optional[int]) -> tuple[PlanInput, dict]:
    """``(inp with the batch settings that ``world`` ranks accept, {key: [config's value, planned value]})``.
    ``micro_batch`` (``--micro-batch``) sets ``train.global_batch`` to that many sequences per rank per
    micro-batch, as the dry run reads it. A Hugging Face config has no batch settings: nothing changes."""
    if inp.global_batch is None or inp.eval_batch is None:
        return inp, {}
    values = {"train.global_batch": inp.global_batch, "train.grad_accum": inp.grad_accum, "eval.batch": inp.eval_batch}
    wanted = dict(values)
    if micro_batch is not None:
        wanted["train.global_batch"] = micro_batch * world * inp.grad_accum
    wanted.update(nearest_valid_batches(wanted["train.global_batch"], wanted["train.grad_accum"],
                                        wanted["eval.batch"], world))
    changed = {k: [values[k], v] for k, v in wanted.items() if v != values[k]}
    return replace(inp, **{_FIELDS[k]: v for k, v in wanted.items()}), changed


def describe_batch_changes(changed: dict, world: int) -> str:
    """One sentence: what was changed and the trainer's rule that asks for it."""
    parts = [f"{key} {old} -> {new}" for key, (old, new) in changed.items()]
    return (", ".join(parts) + f": at {world} ranks the trainer needs train.global_batch / train.grad_accum >= {world} "
            f"sequences per forward and eval.batch >= {world} (one sequence per rank; the nearest accepted values)")


def _key(override: str) -> str:
    return override.split("=", 1)[0].strip()


def recommended_command(source: str, kind: str, user_overrides: Iterable[str], best: dict, changed: dict,
                        cluster: dict, seq_len: Optional[int], micro_batch: Optional[int] = None) -> dict:
    """``overrides`` (the user's, then the layout's and the batch's, each key once), the ``train``
    command (None for a Hugging Face config: upcycle or import it first) and the ``dry_run`` command
    (for a Hugging Face config with ``--micro-batch``, passed on: it has no batch setting to carry it)."""
    ours = [f"parallel.ep={best['ep']}",
            f"train.activation_checkpointing={str(best['activation_checkpointing']).lower()}"]
    if best.get("grad_sync", "step") != "step":
        ours.append(f"parallel.grad_sync={best['grad_sync']}")
    if seq_len is not None:
        ours.append(f"train.seq_len={seq_len}")
    ours += [f"{key}={new}" for key, (_, new) in changed.items()]
    replaced = {_key(o) for o in ours}
    overrides = [o for o in user_overrides if _key(o) not in replaced] + ours
    args = " ".join(shlex.quote(o) for o in overrides)
    config = shlex.quote(source)
    per_rank = f" --micro-batch {micro_batch}" if micro_batch is not None and kind != "moe_dist" else ""
    return {"overrides": overrides,
            "train": f"moe-dist train --config {config} {args}" if kind == "moe_dist" else None,
            "dry_run": (f"moe-dist plan --config {config} --nodes {cluster['nodes']} --gpus-per-node "
                        f"{cluster['gpus_per_node']} --gpu-mem-gib {cluster['gpu_mem_gib']:g}{per_rank} --dry-run {args}")}
