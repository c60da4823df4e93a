"""What a test reads of a training run's directory while the run may still be going: its text files,
its metrics rows and its complete checkpoints."""
from __future__ import annotations

import json
import os

import pytest

from moe_dist.train.checkpoint.files import scan


def read_text(path: str) -> str:
    """A log or output file, whatever bytes a crashed process left in it."""
    with open(path, errors="replace") as f:
        return f.read()


def metrics_rows(run_dir: str) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` written so far (none before the file exists; a row still
    being written is left out)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def complete_checkpoints(run_dir: str) -> list[int]:
    """The steps of the checkpoints a resume would consider (their completion manifest parses)."""
    return [step for step, _ in scan(run_dir)[0]]


def _expert_counts(row: dict) -> dict | None:
    """Each MoE layer's expert counts of one metrics row (None when the row carries no router statistics)."""
    moe = row.get("moe")
    return {layer: stats["expert_counts"] for layer, stats in moe.items()} if moe else None


def assert_curve_matches(rows: list[dict], reference: list[dict], rel: float = 1e-5, agree_at_least: int = 4,
                         after_parting: float = 1e-3) -> int | None:
    """``rows`` (metrics rows, step by step) compute what ``reference`` computed: the loss within ``rel`` at
    every step before the first one whose expert counts differ, and within ``after_parting`` after it.

    Two layouts of the same job (1 process and R ranks) sum in different orders, so their weights differ
    by rounding; a token whose two best experts score within that rounding may go to the other one, and
    from that step on the curves part by more than rounding while staying close. Where that happens is a
    matter of the machine's kernels (the Slurm tests' job parts at step 12 on one CPU, not at all on
    another), so the exact claim holds up to it; the router's statistics must agree for the first
    ``agree_at_least`` rows (a fault in the reduction across ranks shows from the first step). Returns
    the step at which the routing parted, or None.
    """
    assert [r["step"] for r in rows] == [r["step"] for r in reference], ([r["step"] for r in rows],
                                                                         [r["step"] for r in reference])
    n = next((i for i, (r, ref) in enumerate(zip(rows, reference)) if _expert_counts(r) != _expert_counts(ref)),
             len(rows))  # the rows before the routing parted
    assert n >= min(agree_at_least, len(rows)), \
        f"the routing parted at step {rows[n]['step']}: {_expert_counts(rows[n])} vs {_expert_counts(reference[n])}"
    assert [r["loss"] for r in rows[:n]] == pytest.approx([ref["loss"] for ref in reference[:n]], rel=rel, abs=0)
    if n == len(rows):
        return None
    drift = [abs(r["loss"] / ref["loss"] - 1) for r, ref in zip(rows[n:], reference[n:])]
    print(f"the routing parted at step {rows[n]['step']} (a near tie decided by rounding); the loss from there "
          f"within {max(drift):.1e} of the reference's")
    assert max(drift) < after_parting, drift
    return rows[n]["step"]
