"""PNG plots of a run from its metrics.jsonl: loss curves, expert load over time (drawn by
:func:`moe_dist.diagnostics.plots.plot_expert_load`) and the aux-loss-free expert bias."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ...diagnostics.plots import plot_expert_load  # noqa: E402
from ...safe_io import own_directory, write_figure  # noqa: E402
from .metrics import read_metrics  # noqa: E402


def plot_losses(rows: list[dict], path: str, baseline_loss: float | None = None) -> None:
    steps = [r["step"] for r in rows if "loss" in r]
    losses = [r["loss"] for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(steps, losses, lw=1.2, label="train (LM loss)")
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", ms=5, lw=1.5, label="validation")
    if baseline_loss is not None:
        ax.axhline(baseline_loss, ls="--", color="gray", lw=1, label=f"unigram baseline ({baseline_loss:.2f})")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title("Language-model loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    write_figure(fig, path)
    plt.close(fig)


def load_history(rows: list[dict]) -> dict:
    """``{layer: [(step, [share of the routed pairs per expert]), ...]}`` from the rows' expert counts,
    the history :func:`~moe_dist.diagnostics.plots.plot_expert_load` draws."""
    history: dict[str, list] = {}
    for r in rows:
        for layer, stats in sorted(r.get("moe", {}).items(), key=lambda kv: int(kv[0])):
            counts = stats.get("expert_counts")
            if counts:
                total = max(sum(counts), 1)
                history.setdefault(layer, []).append((r["step"], [c / total for c in counts]))
    return history


def plot_expert_bias(rows: list[dict], path: str) -> None:
    """One panel per MoE layer with an aux-loss-free expert bias: each expert's bias over steps."""
    rows = [r for r in rows if r.get("moe")]
    layers = sorted({k for r in rows for k, v in r["moe"].items() if "expert_bias" in v}, key=int)
    if not layers:
        return
    fig, axes = plt.subplots(len(layers), 1, figsize=(8, 1.2 + 1.8 * len(layers)), dpi=120, squeeze=False)
    for ax, layer in zip(axes[:, 0], layers):
        have = [r for r in rows if "expert_bias" in r["moe"].get(layer, {})]
        bias = np.array([r["moe"][layer]["expert_bias"] for r in have], dtype=float)  # [steps, E]
        steps = [r["step"] for r in have]
        for e in range(bias.shape[1]):
            ax.plot(steps, bias[:, e], lw=1, label=f"expert {e}" if bias.shape[1] <= 16 else None)
        ax.axhline(0.0, color="gray", lw=0.8, ls="--")
        ax.set_ylabel(f"block {layer}\nbias")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("optimizer step")
    axes[0, 0].set_title("Aux-loss-free expert bias (added to the router probabilities for choosing)")
    if len(axes[0, 0].get_legend_handles_labels()[0]):
        axes[0, 0].legend(fontsize=6, ncol=8, loc="upper left")
    fig.tight_layout()
    write_figure(fig, path)
    plt.close(fig)


def make_plots(run_dir: str, baseline_loss: float | None = None) -> list[str]:
    rows = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    out_dir = own_directory(run_dir, "plots")
    paths = [os.path.join(out_dir, "loss.png"), os.path.join(out_dir, "expert_load.png")]
    plot_losses(rows, paths[0], baseline_loss)
    history = load_history(rows)
    if history:
        plot_expert_load(history, paths[1])
    paths.append(os.path.join(out_dir, "expert_bias.png"))
    plot_expert_bias(rows, paths[2])
    return [p for p in paths if os.path.exists(p)]
