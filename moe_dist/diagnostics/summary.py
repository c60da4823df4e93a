"""The one-screen routing summary printed at the end of a run, from its metrics rows.

Per MoE layer, over the last steps of the run: load CV and max-load ratio of the summed
per-expert counts, dead experts (no pair in the whole window), the mean dropped fraction, and
the routing fluctuation of the probe set (the last probe, and the mean over the run's probes).
"""
from __future__ import annotations

from typing import Optional

from .load import load_summary


def routing_summary(rows: list[dict], window: Optional[int] = None) -> dict[str, dict]:
    """``{layer: figures}`` from metrics rows (``{"step", "moe": {layer: {"expert_counts",
    "dropped_fraction"[, "fluct_top1", "fluct_topk"]}}}``). ``window``: the steps summed for the
    load figures, counted back from the last logged step (default: the last tenth of the run, at
    least 1 step)."""
    rows = [r for r in rows if r.get("moe")]
    if not rows:
        return {}
    last = rows[-1]["step"]
    window = window or max(1, last // 10)
    recent = [r for r in rows if r["step"] > last - window]
    out = {}
    for layer in sorted(rows[-1]["moe"], key=lambda k: (len(k), k)):
        mine = [r["moe"][layer] for r in recent if layer in r["moe"]]
        counts = [sum(c) for c in zip(*(m["expert_counts"] for m in mine))]
        load = load_summary(counts)
        probes = [(r["step"], r["moe"][layer]) for r in rows if "fluct_top1" in r["moe"].get(layer, {})]
        out[layer] = {
            "steps": [recent[0]["step"], last], "load_cv": load["load_cv"], "max_load_ratio": load["max_load_ratio"],
            "dead_experts": load["dead_experts"], "num_experts": len(counts),
            "dropped_fraction": sum(m.get("dropped_fraction", 0.0) for m in mine) / len(mine),
            "fluct_top1": probes[-1][1]["fluct_top1"] if probes else None,
            "fluct_topk": probes[-1][1]["fluct_topk"] if probes else None,
            "fluct_top1_mean": sum(p["fluct_top1"] for _, p in probes) / len(probes) if probes else None,
            "probes": len(probes),
        }
    return out


def format_routing_summary(summary: dict[str, dict]) -> str:
    """A small table, one line per layer (see :func:`routing_summary`)."""
    if not summary:
        return "routing: no MoE statistics were logged"
    first, last = next(iter(summary.values()))["steps"]

    def pct(v):
        return "      -" if v is None else f"{100 * v:6.1f}%"

    lines = [f"routing, steps {first}-{last} (fluctuation: probe-set tokens whose experts changed since the "
             "previous probe):",
             "layer  load CV  max/mean   dead  dropped  fluct top-1  top-k set  top-1 mean"]
    for layer, s in summary.items():
        lines.append(f"{layer:>5}  {s['load_cv']:7.3f}  {s['max_load_ratio']:8.2f}  {s['dead_experts']:>2}/{s['num_experts']:<2}"
                     f"  {pct(s['dropped_fraction'])}      {pct(s['fluct_top1'])}    {pct(s['fluct_topk'])}     "
                     f"{pct(s['fluct_top1_mean'])}")
    return "\n".join(lines)
