"""What a test reads of a training run's directory while the run may still be going: its text files,
its metrics rows and its complete checkpoints."""
from __future__ import annotations

import json
import os

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
