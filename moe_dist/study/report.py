"""The study's numbers over seeds and its markdown report.

Per router (and variant), over the seeds that finished: mean and sample standard deviation
of each figure. Against a comparison router (the study's ``reference`` for every router, and
a router's own ``compare_to``) the differences are *paired by seed*: the same seed gives both
runs the same data order and the same initial weights wherever their parameters coincide.
"""
from __future__ import annotations

import math
import statistics
from typing import Iterable, Optional

from .spec import Study


def mean_std(values: Iterable[Optional[float]]) -> dict:
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return {"n": 0, "mean": None, "std": None}
    return {"n": len(vals), "mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else None}


def _by_key(records: list[dict]) -> dict[tuple[str, str], dict[int, dict]]:
    out: dict[tuple[str, str], dict[int, dict]] = {}
    for r in records:
        if r["status"] == "done":
            out.setdefault((r["router"], r["variant"]), {})[r["seed"]] = r
    return out


def _fluct_last(r: dict) -> Optional[float]:
    return r["fluctuation"][-1]["top1"] if r.get("fluctuation") else None


def _fluct_mean(r: dict) -> Optional[float]:
    f = r.get("fluctuation") or []
    return statistics.fmean(x["top1"] for x in f) if f else None


FIGURES = {  # name: how to read it from a run record
    "val_ppl": lambda r: r["val_ppl"],
    "tokens_per_s": lambda r: r.get("tokens_per_s"),
    "train_time_s": lambda r: r.get("train_time_s"),
    "cpu_step_s": lambda r: r.get("cpu_step_s"),
    "load_cv": lambda r: r["load"].get("load_cv"),
    "max_load_ratio": lambda r: r["load"].get("max_load_ratio"),
    "dead_experts": lambda r: r["load"].get("dead_experts"),
    "fluct_top1_last": _fluct_last,
    "fluct_top1_mean": _fluct_mean,
}


def _paired(runs: dict[int, dict], base: dict[int, dict], fn) -> dict:
    seeds = sorted(set(runs) & set(base))
    diffs = []
    for s in seeds:
        a, b = fn(runs[s]), fn(base[s])
        if a is not None and b is not None:
            diffs.append((a, b))
    return {"seeds": len(diffs), "diff": mean_std(a - b for a, b in diffs),
            "ratio": mean_std(a / b for a, b in diffs if b), "lower": sum(a < b for a, b in diffs)}


def aggregate(study: Study, records: list[dict]) -> dict:
    """``{"routers": [...], "comparisons": [...]}``: per router/variant figures and paired comparisons."""
    groups = _by_key(records)
    routers = []
    for label, entry in study.routers.items():
        for variant in study.variants:
            runs = groups.get((label, variant), {})
            row = {"router": label, "name": entry.router, "options": entry.options, "variant": variant,
                   "seeds_done": sorted(runs), "seeds_planned": len(study.seeds)}
            for name, fn in FIGURES.items():
                row[name] = mean_std(fn(r) for r in runs.values())
            ks = sorted({int(k) for r in runs.values() for k in r.get("eval_k", {})})
            row["eval_k"] = {str(k): mean_std(r.get("eval_k", {}).get(str(k)) for r in runs.values()) for k in ks}
            active = {r["parameters"]["active"] for r in runs.values() if r.get("parameters")}
            total = {r["parameters"]["total"] for r in runs.values() if r.get("parameters")}
            row["active_params"] = sorted(active)
            row["total_params"] = sorted(total)
            routers.append(row)
    comparisons = []
    for label, entry in study.routers.items():
        targets = [t for t in (study.reference, entry.compare_to) if t and t != label]
        for target in dict.fromkeys(targets):
            for variant in study.variants:
                runs, base = groups.get((label, variant), {}), groups.get((target, variant), {})
                cmp = {"router": label, "against": target, "variant": variant,
                       "declared": target == entry.compare_to}
                for name, fn in FIGURES.items():
                    cmp[name] = _paired(runs, base, fn)
                ks = sorted({k for r in runs.values() for k in r.get("eval_k", {})} &
                            {k for r in base.values() for k in r.get("eval_k", {})}, key=int)
                cmp["eval_k"] = {k: _paired(runs, base, lambda r, k=k: r.get("eval_k", {}).get(k)) for k in ks}
                comparisons.append(cmp)
    return {"routers": routers, "comparisons": comparisons}


# ---- markdown ---------------------------------------------------------------------------------
def fmt(stat: dict, digits: int = 2, pct: bool = False) -> str:
    if not stat or stat.get("mean") is None:
        return "-"
    scale, unit = (100.0, "%") if pct else (1.0, "")
    text = f"{stat['mean'] * scale:.{digits}f}{unit}"
    if stat.get("std") is not None:
        text += f" ± {stat['std'] * scale:.{digits}f}"
    return text


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _label(row: dict, one_variant: bool) -> str:
    name = row["router"] if one_variant else f"{row['router']} / {row['variant']}"
    return name if row["router"] == row["name"] else f"{name} (`{row['name']}`)"


def render_markdown(study: Study, records: list[dict], agg: dict, figures: list[str], base_summary: dict) -> str:
    one_variant = len(study.variants) == 1
    done = sum(r["status"] == "done" for r in records)
    lines = [f"# Router study: {study.path}", ""]
    lines += [f"{done} of {len(records)} runs finished ({len(study.routers)} routers x {len(study.variants)} "
              f"variant(s) x {len(study.seeds)} seeds {study.seeds}). Base config `{study.base}`; every run: "
              f"{base_summary}. Runs used {study.processes_per_run} process(es) x {study.threads_per_run} thread(s), "
              f"{study.runs_at_once} at a time. Figures are mean ± sample standard deviation over seeds; "
              f"comparisons are paired by seed against `{study.reference}` (the reference) and against a "
              "router's declared comparison.", ""]
    missing = [r for r in records if r["status"] != "done"]
    if missing:
        lines += ["Not finished: " + ", ".join(f"{r['name']} ({r['status']}, step {r.get('last_step', 0)})"
                                                for r in missing), ""]
    lines += ["## Per router", ""]
    rows = []
    for row in agg["routers"]:
        active = ", ".join(f"{a / 1e6:.2f}M" for a in row["active_params"]) or "-"
        rows.append([_label(row, one_variant), f"{len(row['seeds_done'])}/{row['seeds_planned']}", active,
                     fmt(row["val_ppl"]), fmt(row["tokens_per_s"], 0), fmt(row["train_time_s"], 1),
                     fmt(row["cpu_step_s"], 3),
                     fmt(row["load_cv"], 3), fmt(row["max_load_ratio"], 3), fmt(row["dead_experts"], 2),
                     fmt(row["fluct_top1_last"], 1, pct=True), fmt(row["fluct_top1_mean"], 1, pct=True)])
    lines += _table(["router", "seeds", "active params", "val ppl", "tokens/s", "train time (s)", "CPU s/step", "load CV",
                     "max-load ratio", "dead experts", "fluctuation (last)", "fluctuation (mean)"], rows)
    lines += ["", "- val ppl: validation perplexity after the last step (routers with a k schedule: at the k "
              "training ends with).",
              "- tokens/s: median over the steps after the first; train time: steps x median step time.",
              "- CPU s/step: median CPU time of a step (the first process, all its threads): other jobs on the "
              "machine move it far less than the wall-clock figures; compare with it when the machine was shared.",
              "- load CV, max-load ratio (max / mean tokens per expert), dead experts (experts without a token in "
              "a step's batch): per step, averaged over the MoE layers and the last quarter of the steps.",
              "- fluctuation: share of the fixed probe tokens whose top-1 expert changed since the previous "
              "evaluation, averaged over the MoE layers; at the last evaluation and averaged over all.", ""]
    ks = sorted({int(k) for row in agg["routers"] for k in row["eval_k"]})
    if ks:
        lines += ["## Validation perplexity at inference k", ""]
        rows = [[_label(row, one_variant), *(fmt(row["eval_k"].get(str(k))) for k in ks)]
                for row in agg["routers"] if row["eval_k"]]
        lines += _table(["router", *(f"k={k}" for k in ks)], rows) + [""]
    lines += ["## Paired comparisons", ""]
    rows = []
    for c in agg["comparisons"]:
        name = c["router"] if one_variant else f"{c['router']} / {c['variant']}"
        extra = "; ".join(f"k={k}: {fmt(v['diff'])}" for k, v in c["eval_k"].items())
        rows.append([name, c["against"] + (" (declared)" if c["declared"] else ""), str(c["val_ppl"]["seeds"]),
                     fmt(c["val_ppl"]["diff"]), f"{c['val_ppl']['lower']}/{c['val_ppl']['seeds']}",
                     fmt(c["train_time_s"]["ratio"], 3), fmt(c["cpu_step_s"]["ratio"], 3), fmt(c["tokens_per_s"]["ratio"], 3),
                     fmt(c["load_cv"]["diff"], 3), fmt(c["max_load_ratio"]["diff"], 3),
                     fmt(c["fluct_top1_mean"]["diff"], 1, pct=True), extra or "-"])
    lines += _table(["router", "against", "seeds", "Δ val ppl", "lower ppl (seeds)", "time ratio", "CPU time ratio",
                     "tokens/s ratio",
                     "Δ load CV", "Δ max-load", "Δ fluctuation (mean)", "Δ ppl at inference k"], rows)
    lines += ["", "Δ = router − against, per seed, then mean ± std over seeds; ratios likewise. Timings are "
              "comparable only between runs that had the same cores to themselves (see the study's "
              "`runs_at_once`).", ""]
    if figures:
        lines += ["## Figures", ""] + [f"![{f}](figures/{f})" for f in figures] + [""]
    lines += ["Raw numbers: `study.json` (every run's record and the aggregates).", ""]
    return "\n".join(lines)
