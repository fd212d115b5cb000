"""Histograms binned on the device, written to TensorBoard with ``add_histogram_raw``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lightning_hooks.logging.writer import tensorboard_writers

__all__ = ["log_histogram_raw", "write_histogram_raw"]


def log_histogram_raw(
    loggers: Sequence[Any],
    tag: str,
    edges: np.ndarray,
    counts: np.ndarray,
    moments: tuple[float, float, float, float],
    step: int,
) -> None:
    """Write pre-binned counts to every TensorBoard logger among ``loggers``.

    Args:
        loggers: the Trainer's loggers; those that are not TensorBoard loggers are skipped.
        tag: the histogram's tag.
        edges: ``[bins + 1]`` bin edges.
        counts: ``[bins]`` counts.
        moments: ``(min, max, sum, sum of squares)`` of the values binned.
        step: the global step.
    """
    low, high, total, sum_sq = moments
    raw = {
        "min": low,
        "max": high,
        "num": float(counts.sum()),
        "sum": total,
        "sum_squares": sum_sq,
        "bucket_limits": [float(e) for e in edges[1:]],
        "bucket_counts": [float(c) for c in counts],
    }
    write_histogram_raw(loggers, tag, raw, step)


def write_histogram_raw(
    loggers: Sequence[Any], tag: str, raw: Mapping[str, Any], step: int
) -> None:
    """Write ``add_histogram_raw`` keyword arguments to every TensorBoard logger."""
    for writer in tensorboard_writers(loggers):
        writer.add_histogram_raw(tag, global_step=step, **raw)
