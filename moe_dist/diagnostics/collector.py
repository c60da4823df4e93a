"""The run's routing-diagnostics collector (:class:`RoutingDiagnostics`): the per-layer routing
figures of a run, in one object the trainer calls.

    diag = RoutingDiagnostics()
    row["moe"][layer].update(...)  <- diag.update(step, stats)            # load balance, each log step
    diag.evaluate_probe(model, probe_tokens, step=step, group=dp_group)   # fluctuation, each evaluation
    diag.record_graphs(model)                                             # Symphony graphs (snapshot)
    diag.write_pngs(run_dir / "plots")                                   # pictures, at the end

The load and fluctuation figures ride in the trainer's metrics row (``row["moe"]``), which the
metrics logger writes to metrics.jsonl and TensorBoard.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed.collectives import all_reduce_sum
from .fluctuation import fluctuation_counts, layer_keys, probe_assignments
from .load import load_summary

PICTURES = ("load", "fluctuation", "graph")


def _per_layer(stats) -> list[tuple[str, Any]]:
    if isinstance(stats, nn.Module):
        return [(k, m.stats) for k, m in layer_keys(stats).items()]
    if isinstance(stats, dict):
        return [(str(k), v) for k, v in stats.items()]
    return [(str(i), v) for i, v in enumerate(stats)]


class RoutingDiagnostics:
    """Collects, over a run: per-expert load per layer (at each ``update``), the routing
    fluctuation of a fixed probe set (at each ``evaluate_probe``) and Symphony graphs
    (``record_graphs``); writes PNGs. Layers are keyed by block index
    (strings, like the trainer's ``row["moe"]``)."""

    def __init__(self):
        self.load_history: dict[str, list[tuple[int, list[float]]]] = {}
        self.fluct_history: dict[str, list[tuple[int, dict]]] = {}
        self.graphs: dict[str, tuple[Any, int]] = {}
        self._probe_prev: Optional[dict[str, torch.Tensor]] = None
        self._saved_probe: Optional[tuple] = None  # (the _probe_prev it is of, its gathered JSON form)
        # after a resume: the whole probe set's last assignments, split at the next evaluation
        self._probe_prev_global: Optional[dict[str, torch.Tensor]] = None

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
        if self._probe_prev is None and self._probe_prev_global is not None:
            self._probe_prev = _my_share(self._probe_prev_global, cur, group)
            self._probe_prev_global = None
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
        """Snapshot the expert graph of every layer whose router has one (``Router.expert_graph_state``).
        Returns how many layers have one."""
        for key, layer in layer_keys(model).items():
            state = layer.router.expert_graph_state()
            if state is not None:
                graph, updates = state
                self.graphs[key] = (graph.detach().float().cpu().numpy().copy(), int(updates))
        return len(self.graphs)

    # ---- output ----------------------------------------------------------------------------
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
    def state_dict(self, group: Optional[dist.ProcessGroup] = None) -> dict:
        """Histories and the last probe assignments of the whole probe set (the ranks' shares of
        ``group`` concatenated in rank order), JSON-safe. Collective over ``group``."""
        prev = self._probe_prev
        # the gathered assignments change only at a probe evaluation (collective: the same calls on every
        # rank), so a state saved every step (in-memory snapshots) gathers them once per evaluation
        if self._saved_probe is None or self._saved_probe[0] is not prev:
            if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
                shares = [None] * dist.get_world_size(group)
                dist.all_gather_object(shares, None if prev is None else {k: v.cpu() for k, v in prev.items()},
                                       group=group)
                whole = (None if any(p is None for p in shares)
                         else {k: torch.cat([p[k] for p in shares]) for k in shares[0]})
            else:
                whole = prev if prev is not None else self._probe_prev_global  # (resumed, not yet evaluated)
            self._saved_probe = (prev, None if whole is None else {k: _encode_ids(v) for k, v in whole.items()})
        return {"load_history": {k: [[s, list(v)] for s, v in rows] for k, rows in self.load_history.items()},
                "fluct_history": {k: [[s, dict(v)] for s, v in rows] for k, rows in self.fluct_history.items()},
                "probe_prev": self._saved_probe[1]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; the probe assignments are split among the ranks at the next
        :meth:`evaluate_probe` (any layout whose probe set is the same)."""
        self.load_history = {k: [(int(s), list(v)) for s, v in rows] for k, rows in state["load_history"].items()}
        self.fluct_history = {k: [(int(s), dict(v)) for s, v in rows] for k, rows in state["fluct_history"].items()}
        saved = state.get("probe_prev")
        self._probe_prev, self._saved_probe = None, None
        self._probe_prev_global = None if not saved else {k: _decode_ids(v) for k, v in saved.items()}


def _encode_ids(ids: torch.Tensor) -> dict:
    """``[T, k]`` expert ids as a compact JSON value (little-endian int32, base64)."""
    import base64

    arr = ids.to(torch.int32).contiguous().cpu().numpy().astype("<i4")
    return {"shape": list(arr.shape), "int32_b64": base64.b64encode(arr.tobytes()).decode("ascii")}


def _decode_ids(value: dict) -> torch.Tensor:
    import base64

    import numpy as np

    raw = base64.b64decode(value["int32_b64"].encode("ascii"), validate=True)
    arr = np.frombuffer(raw, dtype="<i4")
    shape = [int(n) for n in value["shape"]]
    if arr.size != int(np.prod(shape)):
        raise ValueError(f"probe assignments: {arr.size} ids for shape {shape}")
    return torch.from_numpy(arr.reshape(shape).astype(np.int64))


def _my_share(whole: dict[str, torch.Tensor], cur: dict[str, torch.Tensor],
              group: Optional[dist.ProcessGroup]) -> Optional[dict[str, torch.Tensor]]:
    """This rank's rows of the saved whole-probe assignments, placed by the ranks' current probe
    sizes (rank order); None when the probe set or the layers changed since they were saved."""
    rows = next(iter(cur.values())).shape[0] if cur else 0
    sizes = [rows]
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        sizes = [None] * dist.get_world_size(group)
        dist.all_gather_object(sizes, rows, group=group)
        me = dist.get_rank(group)
    else:
        me = 0
    start = sum(sizes[:me])
    if set(whole) != set(cur) or any(whole[k].shape != (sum(sizes), cur[k].shape[1]) for k in cur):
        return None
    return {k: whole[k][start:start + rows] for k in cur}
