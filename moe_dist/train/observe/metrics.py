"""The rows of metrics.jsonl, their TensorBoard scalars (and W&B, see tracking), and reading them back."""
from __future__ import annotations

import json
import os
from typing import Optional

from ...safe_io import LOG_LIMIT, open_append, read_json_lines


def scalar_tag(key: str) -> str:
    """The chart name of a top-level metrics.jsonl field: ``train/loss``, ``val/ppl``."""
    return f"val/{key[4:]}" if key.startswith("val_") else f"train/{key}"


def layer_tag(layer: str, key: str) -> str:
    """The chart name of an MoE layer's figure: ``moe_layer0/aux_loss``."""
    return f"moe_layer{layer}/{key}"


def max_load_ratio(counts: Optional[list]) -> Optional[float]:
    """The busiest expert's load over the mean load (None without counts)."""
    if not counts or sum(counts) <= 0:
        return None
    return max(counts) * len(counts) / sum(counts)


class MetricsLogger:
    """metrics.jsonl rows, TensorBoard scalars and, with a ``tracker`` (``log.wandb``), the same rows
    to Weights & Biases (rank 0 only; other ranks get a no-op logger)."""

    def __init__(self, run_dir: Optional[str], tensorboard: bool, tracker=None, first_step: int = 1):
        self.path = os.path.join(run_dir, "metrics.jsonl") if run_dir else None
        self._file = open_append(self.path) if self.path else None
        self._tb = None
        self._tracker = tracker
        if run_dir and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run replays the steps after its checkpoint: purge_step makes TensorBoard drop what
            # an earlier attempt logged from that step on, so that every step shows once
            self._tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=first_step if first_step > 1 else None)

    def log(self, row: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = row["step"]
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(scalar_tag(key), value, step)
            for key, value in row.get("time", {}).items():  # a profiled step's split (train/observe/step_time.py)
                self._tb.add_scalar(f"time/{key}", value, step)
            for layer, stats in row.get("moe", {}).items():
                for key in ("aux_loss", "z_loss", "entropy", "dropped_fraction", "load_cv", "dead_experts",
                            "fluct_top1", "fluct_topk", "groups_per_token_mean", "groups_per_token_max"):
                    if key in stats:
                        self._tb.add_scalar(layer_tag(layer, key), stats[key], step)
                ratio = max_load_ratio(stats.get("expert_counts"))
                if ratio is not None:
                    self._tb.add_scalar(layer_tag(layer, "max_load_ratio"), ratio, step)
        if self._tracker is not None:
            self._tracker.log(row)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(path: str) -> list[dict]:
    """The whole rows of a metrics.jsonl (a line a crash cut short is left out: see
    :func:`~moe_dist.train.checkpoint.resume.TrainingCheckpoints` for where it is set aside)."""
    return read_json_lines(path, LOG_LIMIT)[0]
