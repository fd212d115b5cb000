"""The pictures the callbacks log: charts, and layer outputs as images.

The charts are drawn with matplotlib's object API (no pyplot: no global state, no GUI backend).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator
from typing_extensions import TypedDict, Unpack

__all__ = ["feature_map_grid", "grad_flow_figure", "layer_epoch_heatmap", "layer_time_figure"]


_MAX_WIDTH = 24.0
_MAX_LABELS = 60
_LAYER_AXIS = "layer (input to output)"


def _labels(layers: Sequence[str]) -> list[str]:
    """Return layer names as tick labels, a long one cut to its last 32 characters."""
    return [name if len(name) <= 32 else "…" + name[-31:] for name in layers]


def _label_size(n: int) -> int:
    """Return the layer labels' font size: large enough for TensorBoard's card for few layers."""
    return 11 if n <= 16 else 9 if n <= 30 else 7


class _BarStyle(TypedDict, total=False):
    """How :func:`_bars` draws its bars."""

    color: str
    label: str


def _bars(
    ax: Axes,
    x: np.ndarray,
    heights: np.ndarray,
    floor: float,
    width: float,
    **style: Unpack[_BarStyle],
) -> None:
    """Draw bars from ``floor`` to ``heights`` at ``x`` as one artist.

    ``ax.bar`` would make one artist per bar, which is slow.

    Args:
        ax: the axes the bars are drawn on.
        x: each bar's centre.
        heights: each bar's top.
        floor: where every bar starts (the axis floor of a log scale).
        width: each bar's width.
        **style: the bars' colour and legend label.

    Example:
        >>> fig = Figure()
        >>> ax = fig.add_subplot()
        >>> _bars(ax, np.arange(2), np.array([1.0, 3.0]), 0.0, 0.5, label="b")
        >>> ax.collections[0].get_paths()[1].vertices[:4].tolist()
        [[0.75, 0.0], [0.75, 3.0], [1.25, 3.0], [1.25, 0.0]]
    """
    left = x - width / 2
    right = x + width / 2
    low = np.full(len(x), floor)
    corners = [(left, low), (left, heights), (right, heights), (right, low)]
    verts = np.stack([np.stack(corner, axis=1) for corner in corners], axis=1)
    ax.add_collection(PolyCollection(list(verts), alpha=0.6, **style))


def grad_flow_figure(
    layers: Sequence[str], mean_abs: np.ndarray, max_abs: np.ndarray, title: str = ""
) -> Figure:
    """Draw bars of mean and max ``|grad|`` per layer, input to output, on a log scale.

    Zero and non-finite values are drawn at the axis floor, marked with a red ``x``.

    Args:
        layers: the layers' names, input to output.
        mean_abs: each layer's mean ``|grad|``.
        max_abs: each layer's max ``|grad|``.
        title: the chart's title (default: ``"gradient flow"``).

    Returns:
        The figure.

    Example:
        >>> fig = grad_flow_figure(["a", "b"], np.array([1e-3, 0.0]), np.array([1e-2, 1e-1]))
        >>> fig.axes[0].get_yscale()
        'log'
        >>> [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
        ['max |grad|', 'mean |grad|', 'zero or non-finite']
    """
    n = len(layers)
    fig = Figure(figsize=(min(_MAX_WIDTH, max(4.5, 0.35 * n + 2.0)), 4.5), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(n)
    good_mean, good_max = (np.isfinite(v) & (v > 0) for v in (mean_abs, max_abs))
    finite = np.concatenate([mean_abs[good_mean], max_abs[good_max]])
    floor = float(finite.min()) / 10 if finite.size else 1e-12
    _bars(ax, x, np.where(good_max, max_abs, floor), floor, 0.8, color="c", label="max |grad|")
    _bars(ax, x, np.where(good_mean, mean_abs, floor), floor, 0.5, color="b", label="mean |grad|")
    bad = ~(good_mean & good_max)
    if bad.any():
        marks = np.full(int(bad.sum()), floor)
        ax.scatter(x[bad], marks, color="r", marker="x", s=60, zorder=3, label="zero or non-finite")
    ax.set_yscale("log")
    ax.yaxis.set_minor_locator(NullLocator())  # a deep model's chart: fewer ticks to lay out
    ax.autoscale_view()
    ax.set_ylim(bottom=floor)
    every = -(-n // _MAX_LABELS)
    ax.set_xticks(x[::every], _labels(layers)[::every], rotation=90, fontsize=_label_size(n))
    ax.set(xlim=(-1, n), xlabel=_LAYER_AXIS, ylabel="|gradient|", title=title or "gradient flow")
    ax.legend(loc="upper right")
    ax.grid(True, axis="y", which="major", alpha=0.3)
    return fig


def layer_epoch_heatmap(
    layers: Sequence[str],
    epochs: Sequence[int],
    values: np.ndarray,
    title: str = "",
    log: bool = False,
) -> Figure:
    """Draw ``values[layer, epoch]`` as a heatmap.

    Layers run top (input) to bottom, epochs left to right; non-finite cells (a layer that did
    not run) are grey.

    Args:
        layers: the layers' names, input to output: the rows.
        epochs: the epochs' numbers: the columns.
        values: ``[layers, epochs]``, the value of each cell.
        title: the chart's title.
        log: draw ``log10`` of the values, zeros grey too.

    Returns:
        The figure.

    Example:
        >>> values = np.array([[1.0, 10.0], [0.0, 100.0]])
        >>> fig = layer_epoch_heatmap(["a", "b"], [0, 1], values)
        >>> fig.axes[0].images[0].get_array().tolist()
        [[1.0, 10.0], [0.0, 100.0]]
        >>> fig = layer_epoch_heatmap(["a", "b"], [0, 1], values, log=True)
        >>> fig.axes[0].images[0].get_array().tolist()
        [[0.0, 1.0], [None, 2.0]]
        >>> fig.axes[0].get_yticklabels()[0].get_fontsize(), fig.axes[0].get_xlabel()
        (11.0, 'epoch   (grey: zero or no value)')
    """
    n, num_epochs = values.shape
    if log:
        with np.errstate(divide="ignore", invalid="ignore"):
            values = np.log10(np.where(values > 0, values, np.nan))
    cells = np.ma.masked_invalid(values)
    # TensorBoard shrinks an image to its card (about 330 px wide): 11 pt labels, 0.32 in rows.
    height = min(_MAX_WIDTH / 2, max(3.0, 0.32 * n + 1.5))
    width = min(_MAX_WIDTH, max(4.2, 0.4 * num_epochs + 2.8))
    fig = Figure(figsize=(width, height), layout="constrained")
    ax = fig.add_subplot()
    ax.set_facecolor("0.85")
    image = ax.imshow(cells, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(image, ax=ax, label="log10" if log else None)
    every = -(-n // _MAX_LABELS)
    ax.set_yticks(np.arange(n)[::every], _labels(layers)[::every], fontsize=_label_size(n))
    every = -(-num_epochs // _MAX_LABELS)
    ax.set_xticks(np.arange(num_epochs)[::every], [str(e) for e in epochs][::every])
    ax.set_xlabel("epoch   (grey: zero or no value)" if log else "epoch   (grey: no value)")
    ax.set_ylabel(_LAYER_AXIS)
    ax.set_title(title, fontsize=10, wrap=True)
    return fig


def layer_time_figure(
    layers: Sequence[str], forward_ms: np.ndarray, step_ms: float, title: str = ""
) -> Figure:
    """Draw bars of each layer's forward time per step, input to output, labelled with its share.

    Args:
        layers: the layers' names, input to output.
        forward_ms: each layer's forward time per step, in milliseconds.
        step_ms: the whole step's time, in milliseconds, that each share is of.
        title: the chart's title (default: names the step's time).

    Returns:
        The figure.

    Example:
        >>> fig = layer_time_figure(["conv", "fc"], np.array([3.0, 1.0]), 10.0)
        >>> [t.get_text() for t in fig.axes[0].texts]
        ['30%', '10%']
    """
    n = len(layers)
    fig = Figure(figsize=(max(6.0, 0.35 * n + 2.0), 4.5), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(n)
    ax.bar(x, forward_ms, width=0.7, color="tab:blue", alpha=0.8)
    for xi, value in zip(x, forward_ms, strict=True):
        share = value / step_ms if step_ms > 0 else float("nan")
        ax.text(float(xi), float(value), f"{share:.0%}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, _labels(layers), rotation=90, fontsize=7 if n > 30 else 9)
    ax.set(xlim=(-1, n), xlabel=_LAYER_AXIS, ylabel="forward time per step (ms)")
    ax.set_title(title or f"forward time per layer, step {step_ms:.2f} ms")
    ax.grid(True, axis="y", alpha=0.3)
    return fig


def _normalize(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Scale ``x`` to ``[0, 1]`` by its min and max over ``dims``; a constant slice becomes 0."""
    low = x.amin(dim=dims, keepdim=True)
    span = x.amax(dim=dims, keepdim=True) - low
    return torch.where(span > 0, (x - low) / span.clamp_min(1e-12), torch.zeros_like(x))


def _tile(maps: torch.Tensor, pad: int) -> torch.Tensor:
    """Tile ``[n, h, w]`` maps into one ``[H, W]`` grid, near square, ``pad`` white pixels apart."""
    n, h, w = maps.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = torch.ones(rows * (h + pad) - pad, cols * (w + pad) - pad)
    for i in range(n):
        r, c = divmod(i, cols)
        grid[r * (h + pad) : r * (h + pad) + h, c * (w + pad) : c * (w + pad) + w] = maps[i]
    return grid


def feature_map_grid(output: torch.Tensor, channels: int = 16, min_size: int = 32) -> torch.Tensor:
    """Return a ``[1, H, W]`` image in ``[0, 1]`` (grayscale, ``CHW``) of a layer's batch output.

    * ``[N, C, H, W]`` (``Conv2d``): the first sample's first ``channels`` channels, each scaled
      to its min-max, tiled in a near-square grid, enlarged to at least ``min_size`` pixels.
    * ``[N, C, D, H, W]`` (``Conv3d``): the same, at the middle depth.
    * ``[N, C, L]`` (``Conv1d``): the first sample, one row per channel (first ``channels``).
    * ``[N, F]`` (``Linear``): the whole batch, one row per sample, one column per feature.

    Args:
        output: the layer's output for a batch.
        channels: how many channels to draw.
        min_size: smallest side, in pixels, of a drawn map.

    Returns:
        The image.

    Raises:
        ValueError: the output has fewer than 2 or more than 5 dimensions.

    Example:
        >>> feature_map_grid(torch.randn(2, 6, 8, 8), channels=4).shape
        torch.Size([1, 65, 65])
        >>> feature_map_grid(torch.randn(5, 7)).shape
        torch.Size([1, 5, 7])
    """
    x = output.detach().float().cpu()
    if x.dim() == 5:
        x = x[:, :, x.shape[2] // 2]
    if x.dim() == 4:
        maps = _normalize(x[0, :channels], dims=(1, 2))
        scale = max(1, math.ceil(min_size / min(maps.shape[1:])))
        maps = maps.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2)
        return _tile(maps, pad=1)[None]
    if x.dim() == 3:
        return _normalize(x[0, :channels], dims=(1,))[None]
    if x.dim() == 2:
        return _normalize(x, dims=(0, 1))[None]
    raise ValueError(
        f"feature_map_grid(output=...): expected a tensor with 2 to 5 dimensions, got shape "
        f"{tuple(output.shape)}"
    )
