"""The one histogram writer: device-binned counts to every logger with histograms."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["histogram_raw", "log_histogram"]


def histogram_raw(
    limits: np.ndarray,
    counts: np.ndarray,
    moments: tuple[float, float, float, float] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``SummaryWriter.add_histogram_raw`` for pre-binned counts.

    Args:
        limits: ``[buckets]`` right edges of the buckets.
        counts: ``[buckets]`` counts.
        moments: ``(min, max, sum, sum of squares)`` of the values binned; ``None``: from the
            bucket centres (the first bucket as wide as the second), the filled buckets' span.

    Example:
        >>> raw = histogram_raw(np.array([0.0, 1.0, 2.0]), np.array([0.0, 2.0, 1.0]))
        >>> raw["min"], raw["max"], raw["num"], raw["sum"]
        (0.0, 2.0, 3.0, 2.5)
    """
    if moments is None:
        lower = np.concatenate([[limits[0] - (limits[1] - limits[0])], limits[:-1]])
        centres = (lower + limits) / 2
        filled = np.flatnonzero(counts)
        moments = (
            float(lower[filled[0]]) if filled.size else 0.0,
            float(limits[filled[-1]]) if filled.size else 0.0,
            float((centres * counts).sum()),
            float((centres**2 * counts).sum()),
        )
    low, high, total, sum_sq = moments
    return {
        "min": low,
        "max": high,
        "num": float(counts.sum()),
        "sum": total,
        "sum_squares": sum_sq,
        "bucket_limits": [float(e) for e in limits],
        "bucket_counts": [float(c) for c in counts],
    }


def log_histogram(
    loggers: Sequence[Any],
    tag: str,
    limits: np.ndarray,
    counts: np.ndarray,
    step: int,
    moments: tuple[float, float, float, float] | None = None,
) -> None:
    """Write pre-binned counts to every logger with histograms (TensorBoard, W&B).

    Args:
        loggers: the Trainer's loggers.
        tag: the histogram's tag.
        limits: ``[buckets]`` right edges.
        counts: ``[buckets]`` counts.
        step: the global step.
        moments: see :func:`histogram_raw`.
    """
    from lightning_hooks.logging.sinks import each_sink

    each_sink(loggers, lambda sink: sink.histogram(tag, limits, counts, step, moments))
