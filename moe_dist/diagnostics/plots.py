"""PNG pictures of routing over a run: expert load per layer over steps, fluctuation rate per
layer over evaluations, and Symphony expert graphs."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _save(fig, path: str) -> str:
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def _edges(steps: list) -> np.ndarray:
    """Cell edges halfway between (possibly unevenly spaced) steps."""
    x = np.asarray(steps, dtype=float)
    if len(x) == 1:
        return np.array([x[0] - 0.5, x[0] + 0.5])
    mid = (x[1:] + x[:-1]) / 2
    return np.concatenate([[x[0] - (mid[0] - x[0])], mid, [x[-1] + (x[-1] - mid[-1])]])


def plot_expert_load(history: dict, path: str) -> str:
    """One heatmap per layer: each expert's share of the routed pairs (rows) over steps
    (columns). ``history``: ``{layer: [(step, [share per expert]), ...]}``."""
    layers = list(history)
    fig, axes = plt.subplots(len(layers), 1, figsize=(8, 1.3 + 1.6 * len(layers)), dpi=110, squeeze=False)
    image = None
    for ax, layer in zip(axes[:, 0], layers):
        steps = [s for s, _ in history[layer]]
        share = np.asarray([v for _, v in history[layer]], dtype=float).T  # [E, steps]
        E = share.shape[0]
        image = ax.pcolormesh(_edges(steps), np.arange(E + 1) - 0.5, share, cmap="viridis", vmin=0.0,
                              vmax=min(1.0, 3.0 / E), shading="flat")
        ax.invert_yaxis()
        ax.set_ylabel(f"layer {layer}\nexpert")
        ax.set_yticks(range(0, E, max(1, E // 8)))
    axes[-1, 0].set_xlabel("optimizer step")
    axes[0, 0].set_title("Expert load: share of routed token-expert pairs (balanced = 1/E)")
    fig.colorbar(image, ax=axes[:, 0].tolist(), fraction=0.03, pad=0.02, label="share")
    return _save(fig, path)


def plot_fluctuation(history: dict, path: str) -> str:
    """Share of probe tokens whose top-1 expert (solid) / top-k set (dashed) changed since the
    previous evaluation, one colour per layer. ``history``: ``{layer: [(step, rates), ...]}``."""
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(1, len(history))))
    for color, (layer, rows) in zip(colors, history.items()):
        xs = [s for s, _ in rows]
        ax.plot(xs, [r["fluct_top1"] for _, r in rows], "o-", color=color, ms=4, label=f"layer {layer} top-1")
        ax.plot(xs, [r["fluct_topk"] for _, r in rows], "s--", color=color, ms=3, alpha=0.8,
                label=f"layer {layer} top-k set")
    ax.set_xlabel("optimizer step of the evaluation")
    ax.set_ylabel("share of probe tokens that changed")
    ax.set_ylim(bottom=0)
    ax.set_title("Routing fluctuation since the previous evaluation")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def plot_expert_graphs(graphs: dict, path: str) -> str:
    """Heatmaps of the E x E expert graphs ``{layer: (A as array, updates)}`` side by side."""
    layers = list(graphs)
    cols = min(4, len(layers))
    rows = (len(layers) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), dpi=110, squeeze=False, layout="constrained")
    for ax in axes.flat[len(layers):]:
        ax.axis("off")
    for ax, layer in zip(axes.flat, layers):
        A, updates = graphs[layer]
        A = np.asarray(A, dtype=float)
        image = ax.imshow(A, cmap="magma", interpolation="nearest")
        ax.set_title(f"layer {layer} ({updates} updates)", fontsize=9)
        ticks = range(0, A.shape[0], max(1, A.shape[0] // 8))
        ax.set_xticks(ticks)
        ax.set_yticks(ticks)
        ax.set_xlabel("expert k")
        ax.set_ylabel("expert j")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle("Symphony expert graph A[j, k]")
    return _save(fig, path)
