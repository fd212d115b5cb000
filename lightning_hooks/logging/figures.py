"""Figures rendered with matplotlib's object API (no pyplot: no global state, no GUI backend)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from matplotlib.figure import Figure

__all__ = ["grad_flow_figure", "layer_epoch_heatmap"]


def grad_flow_figure(
    layers: Sequence[str], mean_abs: np.ndarray, max_abs: np.ndarray, title: str = ""
) -> Figure:
    """Bars of mean and max ``|grad|`` per layer, input layer to output layer, on a log scale.

    Zero and non-finite values cannot be drawn on a log axis: they are drawn at the axis floor and
    marked with a red ``x``.

    Example:
        >>> fig = grad_flow_figure(["a", "b"], np.array([1e-3, 0.0]), np.array([1e-2, 1e-1]))
        >>> fig.axes[0].get_yscale()
        'log'
    """
    n = len(layers)
    fig = Figure(figsize=(max(6.0, 0.35 * n + 2.0), 4.5), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(n)
    finite = np.concatenate([v[np.isfinite(v) & (v > 0)] for v in (mean_abs, max_abs)])
    floor = float(finite.min()) / 10 if finite.size else 1e-12
    for values, label, color in ((max_abs, "max |grad|", "c"), (mean_abs, "mean |grad|", "b")):
        shown = np.where(np.isfinite(values) & (values > 0), values, floor)
        ax.bar(x, shown, width=0.8 if color == "c" else 0.5, color=color, alpha=0.6, label=label)
        bad = ~(np.isfinite(values) & (values > 0))
        if bad.any():
            ax.scatter(x[bad], np.full(int(bad.sum()), floor), color="r", marker="x", zorder=3)
    ax.set_yscale("log")
    ax.set_ylim(bottom=floor)
    ax.set_xticks(x, list(layers), rotation=90, fontsize=7 if n > 30 else 9)
    ax.set_xlim(-1, n)
    ax.set_xlabel("layer (input to output)")
    ax.set_ylabel("|gradient|")
    ax.set_title(title or "gradient flow")
    ax.legend(loc="upper right")
    ax.grid(True, axis="y", which="major", alpha=0.3)
    return fig


def layer_epoch_heatmap(
    layers: Sequence[str], epochs: Sequence[int], values: np.ndarray, title: str = ""
) -> Figure:
    """A layer x epoch heatmap of one statistic (``values``: ``[layers, epochs]``).

    Layers run top (input) to bottom (output); NaN cells (a layer that did not run) are blank.

    Example:
        >>> fig = layer_epoch_heatmap(["a", "b"], [0, 1], np.array([[0.1, 0.2], [np.nan, 0.4]]))
        >>> fig.axes[0].get_ylabel()
        'layer'
    """
    n, m = len(layers), len(epochs)
    fig = Figure(
        figsize=(min(14.0, max(5.0, 0.4 * m + 3.0)), max(3.0, 0.25 * n + 1.5)),
        layout="constrained",
    )
    ax = fig.add_subplot()
    image = ax.imshow(np.ma.masked_invalid(values), aspect="auto", interpolation="nearest")
    fig.colorbar(image, ax=ax)
    ax.set_yticks(np.arange(n), list(layers), fontsize=7 if n > 30 else 9)
    step = max(1, m // 20)
    ax.set_xticks(np.arange(0, m, step), [str(e) for e in epochs[::step]])
    ax.set_xlabel("epoch")
    ax.set_ylabel("layer")
    ax.set_title(title)
    return fig
