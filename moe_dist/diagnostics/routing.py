"""RoutingDiagnostics: the per-layer routing figures of a run, in one object the trainer calls.

    diag = RoutingDiagnostics()
    row["moe"][layer].update(...)  <- diag.update(step, stats)            # load balance, each log step
    diag.evaluate_probe(model, probe_tokens, step=step, group=dp_group)   # fluctuation, each evaluation
    diag.record_graphs(model)                                             # Symphony graphs (snapshot)
    diag.write_tensorboard(writer, step, row["moe"]); diag.write_pngs(run_dir / "plots")
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..dist.collectives import all_reduce_sum
from .fluctuation import fluctuation_counts, layer_keys, probe_assignments
from .load import load_summary

PICTURES = ("load", "fluctuation", "graph")
SCALAR_KEYS = ("max_load_ratio", "load_cv", "dead_experts", "dropped_fraction", "entropy", "fluct_top1", "fluct_topk")


def _per_layer(stats) -> list[tuple[str, Any]]:
    if isinstance(stats, nn.Module):
        return [(k, m.stats) for k, m in layer_keys(stats).items()]
    if isinstance(stats, dict):
        return [(str(k), v) for k, v in stats.items()]
    return [(str(i), v) for i, v in enumerate(stats)]


class RoutingDiagnostics:
    """Collects, over a run: per-expert load per layer (at each ``update``), the routing
    fluctuation of a fixed probe set (at each ``evaluate_probe``) and Symphony graphs
    (``record_graphs``); writes TensorBoard scalars and PNGs. Layers are keyed by block index
    (strings, like the trainer's ``row["moe"]``)."""

    def __init__(self):
        self.load_history: dict[str, list[tuple[int, list[float]]]] = {}
        self.fluct_history: dict[str, list[tuple[int, dict]]] = {}
        self.graphs: dict[str, tuple[Any, int]] = {}
        self._probe_prev: Optional[dict[str, torch.Tensor]] = None

    # ---- load balance ----------------------------------------------------------------------
    def update(self, step: int, stats) -> dict[str, dict]:
        """Load figures per layer from ``stats``: a model (its layers' last ``MoEStats``), a list of
        ``MoEStats`` (``collect_stats(model)``) or ``{layer: MoEStats or {"expert_counts": [...]}}``
        (the trainer's per-step summary). Returns ``{layer: {load, max_load_ratio, load_cv,
        dead_experts[, dropped_fraction, entropy]}}`` (host values: call at log time)."""
        out = {}
        for key, s in _per_layer(stats):
            if s is None:
                continue
            if isinstance(s, dict):
                row = load_summary(s["expert_counts"])
            else:
                row = load_summary(s.expert_counts)
                row.update(dropped_fraction=float(s.dropped_fraction), entropy=float(s.entropy))
            out[key] = row
            self.load_history.setdefault(key, []).append((int(step), row["load"]))
        return out

    # ---- fluctuation -----------------------------------------------------------------------
    def evaluate_probe(self, model: nn.Module, probe_tokens: torch.Tensor, step: int,
                       padding_mask: Optional[torch.Tensor] = None, group: Optional[dist.ProcessGroup] = None,
                       forward: Optional[Callable] = None) -> dict[str, dict]:
        """Route the fixed probe set (this rank's share of it) in eval mode and compare with the
        previous evaluation. Returns ``{layer: {"fluct_top1", "fluct_topk"}}``, empty at the first
        evaluation. Collective: every rank of ``group`` calls it (counts are summed over it)."""
        cur = probe_assignments(model, probe_tokens, padding_mask, forward)
        prev, self._probe_prev = self._probe_prev, cur
        if prev is None:
            return {}
        if set(prev) != set(cur):
            raise ValueError(f"MoE layers changed between probe evaluations: {sorted(prev)} vs {sorted(cur)}")
        keys = sorted(cur, key=lambda k: (len(k), k))
        device = next(iter(model.parameters())).device if any(True for _ in model.parameters()) else torch.device("cpu")
        counts = torch.stack([fluctuation_counts(prev[k], cur[k]) for k in keys]).to(device)
        counts = all_reduce_sum(counts, group).cpu()
        out = {}
        for k, (top1, topk, n) in zip(keys, counts.tolist()):
            out[k] = {"fluct_top1": top1 / max(n, 1), "fluct_topk": topk / max(n, 1)}
            self.fluct_history.setdefault(k, []).append((int(step), out[k]))
        return out

    # ---- Symphony graphs -------------------------------------------------------------------
    def record_graphs(self, model: nn.Module) -> int:
        """Snapshot the expert graph of every layer whose router has one (``expert_graph``).
        Returns how many layers have one."""
        for key, layer in layer_keys(model).items():
            router = layer.router
            if callable(getattr(router, "expert_graph", None)):
                self.graphs[key] = (router.A.detach().float().cpu().numpy().copy(), int(router.n_updates))
        return len(self.graphs)

    # ---- output ----------------------------------------------------------------------------
    @staticmethod
    def tensorboard_scalars(moe_rows: dict[str, dict], keys=SCALAR_KEYS) -> dict[str, float]:
        """``{"moe_layer{l}/{key}": value}`` for the scalar diagnostics in ``{layer: figures}``."""
        return {f"moe_layer{layer}/{k}": float(v) for layer, row in moe_rows.items() for k, v in row.items()
                if k in keys and isinstance(v, (int, float)) and not isinstance(v, bool)}

    def write_tensorboard(self, writer, step: int, moe_rows: dict[str, dict]) -> None:
        for tag, value in self.tensorboard_scalars(moe_rows).items():
            writer.add_scalar(tag, value, step)

    def write_pngs(self, plots_dir: str, include=PICTURES) -> list[str]:
        """routing_load.png, routing_fluctuation.png, symphony_graph.png: those in ``include``
        (``load``, ``fluctuation``, ``graph``) that have data. Returns the paths written."""
        from .plots import plot_expert_graphs, plot_expert_load, plot_fluctuation

        bad = sorted(set(include) - set(PICTURES))
        if bad:
            raise ValueError(f"write_pngs: unknown picture(s) {bad}; allowed: {list(PICTURES)}")
        os.makedirs(plots_dir, exist_ok=True)
        paths = []
        if "load" in include and self.load_history:
            paths.append(plot_expert_load(self.load_history, os.path.join(plots_dir, "routing_load.png")))
        if "fluctuation" in include and self.fluct_history:
            paths.append(plot_fluctuation(self.fluct_history, os.path.join(plots_dir, "routing_fluctuation.png")))
        if "graph" in include and self.graphs:
            paths.append(plot_expert_graphs(self.graphs, os.path.join(plots_dir, "symphony_graph.png")))
        return paths

    # ---- resume ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Histories and the last probe assignments (tensors and plain containers only)."""
        return {"load_history": {k: [[s, list(v)] for s, v in rows] for k, rows in self.load_history.items()},
                "fluct_history": {k: [[s, dict(v)] for s, v in rows] for k, rows in self.fluct_history.items()},
                "probe_prev": self._probe_prev}

    def load_state_dict(self, state: dict) -> None:
        self.load_history = {k: [(int(s), list(v)) for s, v in rows] for k, rows in state["load_history"].items()}
        self.fluct_history = {k: [(int(s), dict(v)) for s, v in rows] for k, rows in state["fluct_history"].items()}
        self._probe_prev = state["probe_prev"]
