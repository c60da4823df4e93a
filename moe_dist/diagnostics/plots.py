"""PNG pictures of routing over a run: expert load per layer over steps, fluctuation rate per
layer over evaluations, and Symphony expert graphs."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ..safe_io import write_figure  # noqa: E402


def _save(fig, path: str) -> str:
    write_figure(fig, path, bbox_inches="tight")
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
    """Routing fluctuation over training: the share of probe tokens whose top-1 expert (left) and
    whose set of k experts (right) changed since the previous probe, one curve per layer, from
    step 0. ``history``: ``{layer: [(step, rates), ...]}``."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110, sharey=True, layout="constrained")
    colors = plt.cm.tab10(np.arange(len(history)) % 10)  # distinct colours, one per layer
    last = max((s for rows in history.values() for s, _ in rows), default=1)
    top = 0.0
    for ax, key, what in zip(axes, ("fluct_top1", "fluct_topk"), ("top-1 expert", "set of top-k experts")):
        for color, (layer, rows) in zip(colors, history.items()):
            xs, ys = [s for s, _ in rows], [100 * r[key] for _, r in rows]
            top = max([top, *ys])
            ax.plot(xs, ys, "-", color=color, lw=1.5, marker="o" if len(xs) <= 40 else None, ms=3, label=f"layer {layer}")
        ax.set_title(f"tokens whose {what} changed", fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.set_xlim(0, last * 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("% of probe tokens, since the previous probe")
    axes[0].set_ylim(0, max(1.0, top * 1.08))
    axes[1].legend(fontsize=8, ncol=1 + len(history) // 6, loc="upper right")
    fig.suptitle("Routing fluctuation over training (fixed probe set)")
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
