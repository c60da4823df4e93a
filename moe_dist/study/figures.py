"""The study's PNG figures (matplotlib, no display): one file per question.

val_ppl.png          validation perplexity per router: mean ± std over seeds, each seed a dot
val_curve.png        validation perplexity over training, mean over seeds per router
fluctuation.png      routing fluctuation (top-1 changes of the probe set) over training
load_balance.png     load CV, max-load ratio and dead experts per router
throughput.png       tokens/s and training time relative to the reference router, paired by seed
eval_k.png           validation perplexity against the inference k (routers that have one), and the
                     paired difference of each declared comparison (compare_to) at each k
"""
from __future__ import annotations

import os
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402,F401

from .spec import Study  # noqa: E402


def _labels(agg: dict, one_variant: bool) -> list[str]:
    return [r["router"] if one_variant else f"{r['router']}\n{r['variant']}" for r in agg["routers"]]


def _bars(ax, labels, stats, title, ylabel, dots=None, ref=None):
    xs = range(len(labels))
    means = [s["mean"] if s["mean"] is not None else 0 for s in stats]
    errs = [s["std"] or 0 for s in stats]
    ax.bar(xs, means, yerr=errs, capsize=3, color="#4c72b0", alpha=0.8)
    if dots:
        for x, values in zip(xs, dots):
            ax.plot([x] * len(values), values, "k.", ms=4)
    if ref is not None:
        ax.axhline(ref, color="gray", ls="--", lw=1)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


def _save(fig, path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.basename(path)


def _runs_of(records, row):
    return [r for r in records if r["status"] == "done" and r["router"] == row["router"]
            and r["variant"] == row["variant"]]


def _mean_curve(runs, key, value_key):
    """Mean over seeds at each step that every seed has."""
    series = [{p["step"]: p[value_key] for p in r.get(key) or []} for r in runs]
    if not series:
        return [], []
    steps = sorted(set.intersection(*(set(s) for s in series)))
    return steps, [statistics.fmean(s[st] for s in series) for st in steps]


def write_figures(study: Study, records: list[dict], agg: dict, directory: str) -> list[str]:
    """The study's PNGs in ``directory``: perplexity, curves, load balance, throughput, inference k."""
    os.makedirs(directory, exist_ok=True)
    labels = _labels(agg, len(study.variants) == 1)
    rows = agg["routers"]
    if not any(r["val_ppl"]["n"] for r in rows):
        return []
    width = max(6.0, 0.8 * len(labels) + 2)
    out = [_ppl_figure(study, records, rows, labels, width, directory)]
    out += _curve_figures(records, rows, labels, directory)
    out.append(_load_figure(rows, labels, width, directory))
    out.append(_throughput_figure(study, agg, rows, labels, width, directory))
    with_k = [(label, r) for label, r in zip(labels, rows) if r["eval_k"]]
    if with_k:
        out.append(_eval_k_figure(agg, with_k, directory))
    return out


def _ppl_figure(study: Study, records: list[dict], rows: list[dict], labels: list[str], width: float,
                directory: str) -> str:
    fig, ax = plt.subplots(figsize=(width, 4))
    ref = next((r["val_ppl"]["mean"] for r in rows if r["router"] == study.reference), None)
    _bars(ax, labels, [r["val_ppl"] for r in rows], "Validation perplexity (mean ± std over seeds; dashed: "
          f"{study.reference})", "perplexity", dots=[[x["val_ppl"] for x in _runs_of(records, r)] for r in rows],
          ref=ref)
    finite = [x["val_ppl"] for x in records if x["status"] == "done"]
    if finite:
        lo, hi = min(finite), max(finite)
        pad = max((hi - lo) * 0.3, hi * 0.01)
        ax.set_ylim(max(0, lo - pad), hi + pad)
    return _save(fig, os.path.join(directory, "val_ppl.png"))


def _curve_figures(records: list[dict], rows: list[dict], labels: list[str], directory: str) -> list[str]:
    """Validation perplexity and routing fluctuation over training, one line per router (none drawn: no file)."""
    out = []
    for name, key, value_key, title, ylabel in (
            ("val_curve.png", "val_curve", "ppl", "Validation perplexity over training (mean over seeds)", "perplexity"),
            ("fluctuation.png", "fluctuation", "top1", "Routing fluctuation: share of probe tokens whose top-1 expert\n"
             "changed since the previous evaluation (mean over MoE layers and seeds)", "share of tokens")):
        fig, ax = plt.subplots(figsize=(8, 4.5))
        drawn = False
        for label, row in zip(labels, rows):
            steps, values = _mean_curve(_runs_of(records, row), key, value_key)
            if steps:
                ax.plot(steps, values, "o-", ms=3, lw=1.2, label=label.replace("\n", " / "))
                drawn = True
        if not drawn:
            plt.close(fig)
            continue
        if name == "val_curve.png":
            values = [v for line in ax.get_lines() for v in line.get_ydata()]
            if max(values) > 3 * min(values):
                ax.set_yscale("log")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        out.append(_save(fig, os.path.join(directory, name)))
    return out


def _load_figure(rows: list[dict], labels: list[str], width: float, directory: str) -> str:
    fig, axes = plt.subplots(1, 3, figsize=(3 * width * 0.6, 4))
    for ax, key, title in zip(axes, ("load_cv", "max_load_ratio", "dead_experts"),
                              ("Load CV (0 = even)", "Max-load ratio (1 = even)", "Dead experts per layer and step")):
        _bars(ax, labels, [r[key] for r in rows], title, "")
    return _save(fig, os.path.join(directory, "load_balance.png"))


def _throughput_figure(study: Study, agg: dict, rows: list[dict], labels: list[str], width: float,
                       directory: str) -> str:
    """Speed relative to the reference router (the reference itself at 1)."""
    cmp = {c["router"] + "/" + c["variant"]: c for c in agg["comparisons"] if c["against"] == study.reference}
    one, none = {"n": 1, "mean": 1.0, "std": None}, {"mean": None, "std": None}

    def ratios(key):
        got = [cmp.get(f"{r['router']}/{r['variant']}", {}).get(key, {}).get("ratio") for r in rows]
        return [s if s else (one if r["router"] == study.reference else none) for s, r in zip(got, rows)]

    panels = [("tokens_per_s", f"Tokens/s relative to {study.reference}"),
              ("train_time_s", f"Training time relative to {study.reference}")]
    if any(r["cpu_step_s"]["mean"] for r in rows):
        panels.append(("cpu_step_s", f"CPU time per step relative to {study.reference}"))
    fig, axes = plt.subplots(1, len(panels), figsize=(len(panels) * width * 0.7, 4))
    for ax, (key, title) in zip(axes, panels):
        _bars(ax, labels, ratios(key), title, "ratio", ref=1.0)
    return _save(fig, os.path.join(directory, "throughput.png"))


def _k_axis(ax, ks) -> None:
    """A log2 axis of inference k with the k values as plain ticks."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(ks))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("experts per token at inference (k)")


def _eval_k_figure(agg: dict, with_k: list, directory: str) -> str:
    """Perplexity at each inference k and, where declared, its paired difference from the reference."""
    pairs = [c for c in agg["comparisons"] if c["declared"] and c["eval_k"]]
    fig, axes = plt.subplots(1, 2 if pairs else 1, figsize=(11 if pairs else 6, 4.5), squeeze=False)
    ax = axes[0, 0]
    for label, r in with_k:
        ks = sorted(r["eval_k"], key=int)
        means = [r["eval_k"][k]["mean"] for k in ks]
        errs = [r["eval_k"][k]["std"] or 0 for k in ks]
        ax.errorbar([int(k) for k in ks], means, yerr=errs, marker="o", capsize=3, label=label.replace("\n", " / "))
    ax.set_xscale("log", base=2)
    values = [s["mean"] for _, r in with_k for s in r["eval_k"].values() if s["mean"]]
    if values and max(values) > 3 * min(values):
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    _k_axis(ax, {int(k) for _, r in with_k for k in r["eval_k"]})
    ax.set_ylabel("validation perplexity")
    ax.set_title("Perplexity at inference k (mean ± std over seeds)", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    if pairs:  # the paired difference: what seeds share (data order, initial weights) cancels
        ax = axes[0, 1]
        for c in pairs:
            ks = sorted(c["eval_k"], key=int)
            diffs = [c["eval_k"][k]["diff"] for k in ks]
            ax.errorbar([int(k) for k in ks], [d["mean"] for d in diffs], yerr=[d["std"] or 0 for d in diffs],
                        marker="o", capsize=3, label=f"{c['router']} − {c['against']}")
        ax.axhline(0, color="gray", lw=1, ls="--")
        _k_axis(ax, {int(k) for c in pairs for k in c["eval_k"]})
        ax.set_ylabel("Δ validation perplexity")
        ax.set_title("Paired by seed (mean ± std); below 0: router better", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, os.path.join(directory, "eval_k.png"))
