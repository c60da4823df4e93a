"""Step metrics: MoE routing statistics over a step's micro-batches, metrics.jsonl, TensorBoard."""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch
import torch.nn as nn

from ..dist.collectives import all_reduce_sum
from ..moe import MoELayer

STANDARD_STATS = ("expert_counts", "dropped_fraction", "aux_loss", "z_loss", "entropy", "tokens", "capacity")


class MoEStepStats:
    """Sums per-expert counts and drops, averages losses and entropy, over one step's micro-batches,
    for every MoE layer (keyed by its block index). The layer statistics are already global
    (identical on every rank); router extras a router lists in ``local_extras`` are figures of
    this rank's tokens and are reduced over the ranks in :meth:`summary`."""

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, MoELayer)]
        self.reset()

    def reset(self) -> None:
        self._acc: dict[int, dict[str, Any]] = {}

    def add(self) -> None:
        """Record the layers' statistics of the forward pass that just ran."""
        for layer in self.layers:
            if layer.stats is None:
                continue
            s = layer.stats.as_dict()
            acc = self._acc.setdefault(layer.context.layer_idx, {"n": 0, "tokens": 0, "counts": None, "dropped": 0.0,
                                                                  "pairs": 0.0, "aux": 0.0, "z": 0.0, "entropy": 0.0,
                                                                  "rows": 0, "local": {}, "lists": set()})
            tokens = s["tokens"]
            acc["n"] += 1
            acc["tokens"] += tokens
            acc["counts"] = s["expert_counts"] if acc["counts"] is None else [a + b for a, b in zip(acc["counts"], s["expert_counts"])]
            pairs = sum(s["expert_counts"])
            acc["pairs"] += pairs
            acc["dropped"] += s["dropped_fraction"] * pairs
            acc["aux"] += s["aux_loss"]
            acc["z"] += s["z_loss"]
            acc["entropy"] += s["entropy"] * tokens
            local = getattr(layer.router, "local_extras", {})
            rows = 0 if layer.last_routing is None else int(layer.last_routing.expert_ids.shape[0])
            acc["rows"] += rows
            for key, mode in local.items():
                if key in s:  # a mean: weighted by this rank's router rows; a sum: as it is
                    if isinstance(s[key], list):
                        acc["lists"].add(key)
                    vals = [float(v) * (rows if mode == "mean" else 1) for v in (s[key] if isinstance(s[key], list) else [s[key]])]
                    prev = acc["local"].get(key)
                    acc["local"][key] = vals if prev is None else [a + b for a, b in zip(prev, vals)]
            acc["extras"] = {k: v for k, v in s.items() if k not in STANDARD_STATS and k not in local}
            if "capacity" in s:
                acc["capacity"] = s["capacity"]

    def _reduce_local(self, group, device) -> dict[int, dict[str, Any]]:
        """The ``local_extras`` of every layer over ``group`` (the ranks holding distinct tokens):
        means weighted by router rows, sums summed. One all-reduce; every rank of ``group`` calls it."""
        idxs = sorted(self._acc)
        keys = [(i, k) for i in idxs for k in sorted(self._acc[i]["local"])]
        flat = [float(self._acc[i]["rows"]) for i in idxs] + [v for i, k in keys for v in self._acc[i]["local"][k]]
        if not keys:
            return {}
        total = all_reduce_sum(torch.tensor(flat, dtype=torch.float64, device=device), group).cpu().tolist()
        rows, pos, out = dict(zip(idxs, total[:len(idxs)])), len(idxs), {}
        for i, k in keys:
            n = len(self._acc[i]["local"][k])
            vals, pos = total[pos:pos + n], pos + n
            layer = next(m for m in self.layers if m.context.layer_idx == i)
            if layer.router.local_extras[k] == "mean":
                vals = [v / max(rows[i], 1.0) for v in vals]
            out.setdefault(i, {})[k] = vals if k in self._acc[i]["lists"] else vals[0]
        return out

    def summary(self, group=None, device=None) -> dict[str, dict]:
        """Per-layer figures of the step. Collective over ``group`` when a router has
        ``local_extras`` (every rank calls it)."""
        reduced = self._reduce_local(group, device)
        out = {}
        for layer in self.layers:
            idx = layer.context.layer_idx
            acc = self._acc.get(idx)
            if acc is None:
                continue
            row = {
                "expert_counts": acc["counts"],
                "dropped_fraction": acc["dropped"] / max(acc["pairs"], 1),
                "aux_loss": acc["aux"] / acc["n"],
                "z_loss": acc["z"] / acc["n"],
                "entropy": acc["entropy"] / max(acc["tokens"], 1),
            }
            if "capacity" in acc:
                row["capacity"] = acc["capacity"]
            row.update(acc.get("extras", {}))
            row.update(reduced.get(idx, {}))
            row.update(_plain(layer.router.extra_metrics()))
            out[str(idx)] = row
        return out


def _plain(d: dict) -> dict:
    """JSON-friendly values (tensors become numbers or lists)."""
    out = {}
    for k, v in d.items():
        if hasattr(v, "tolist"):
            v = v.tolist()
        out[k] = v
    return out


class MetricsLogger:
    """metrics.jsonl rows and TensorBoard scalars (rank 0 only; other ranks get a no-op logger)."""

    def __init__(self, run_dir: Optional[str], tensorboard: bool):
        self.path = os.path.join(run_dir, "metrics.jsonl") if run_dir else None
        self._file = open(self.path, "a", encoding="utf-8") if self.path else None
        self._tb = None
        if run_dir and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tb"))

    def log(self, row: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            step = row["step"]
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"train/{key}" if not key.startswith("val_") else f"val/{key[4:]}", value, step)
            for layer, stats in row.get("moe", {}).items():
                for key in ("aux_loss", "z_loss", "entropy", "dropped_fraction", "load_cv", "dead_experts",
                            "fluct_top1", "fluct_topk"):
                    if key in stats:
                        self._tb.add_scalar(f"moe_layer{layer}/{key}", stats[key], step)
                counts = stats.get("expert_counts")
                if counts and sum(counts) > 0:
                    self._tb.add_scalar(f"moe_layer{layer}/max_load_ratio", max(counts) * len(counts) / sum(counts), step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
