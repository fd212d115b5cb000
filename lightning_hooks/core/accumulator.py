"""On-device accumulation of per-layer statistics over an epoch, as a torchmetrics ``Metric``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchmetrics import Metric

__all__ = ["LayerStats", "LayerStatsAccumulator"]

Columns = slice | Sequence[int]


@dataclass(frozen=True)
class LayerStats:
    """Host-side result of an epoch: ``[layers, stats]`` arrays, ``NaN`` where never updated.

    Attributes:
        layers: layer names, one per row.
        stats: statistic names, one per column.
        mean: mean over the updates of each cell.
        peak: maximum over the updates of each cell.
        total: sum over the updates of each cell.
        count: number of updates of each cell.
    """

    layers: tuple[str, ...]
    stats: tuple[str, ...]
    mean: np.ndarray
    peak: np.ndarray
    total: np.ndarray
    count: np.ndarray

    def column(self, stat: str, kind: str = "mean") -> np.ndarray:
        """One statistic for every layer: ``kind`` is ``"mean"``, ``"peak"`` or ``"total"``."""
        table: np.ndarray = getattr(self, kind)
        return table[:, self.stats.index(stat)]


class LayerStatsAccumulator(Metric):
    """Sum, max and count of ``[layers, stats]`` values, kept on the device.

    Each :meth:`update` is a handful of in-place kernels and no host sync. Under
    ``torch.distributed`` :meth:`compute` reduces across ranks (sums and counts summed, maxima
    max-ed): three states, whatever the number of layers.

    Args:
        layers: the row names.
        stats: the column names.

    Example:
        >>> acc = LayerStatsAccumulator(["a", "b"], ["norm"])
        >>> acc.update(torch.tensor([[1.0], [2.0]]))
        >>> acc.update(torch.tensor([[3.0]]), rows=torch.tensor([0]))
        >>> result = acc.result()
        >>> result.mean.tolist(), result.peak.tolist(), result.count.tolist()
        ([[2.0], [2.0]], [[3.0], [2.0]], [[2.0], [1.0]])
    """

    full_state_update = False
    total: torch.Tensor
    peak: torch.Tensor
    count: torch.Tensor

    def __init__(self, layers: Sequence[str], stats: Sequence[str]) -> None:
        super().__init__(sync_on_compute=True, compute_with_cache=False)
        self.layers = tuple(layers)
        self.stats = tuple(stats)
        shape = (len(self.layers), len(self.stats))
        self.add_state("total", torch.zeros(shape), dist_reduce_fx="sum")
        self.add_state("peak", torch.full(shape, -torch.inf), dist_reduce_fx="max")
        self.add_state("count", torch.zeros(shape), dist_reduce_fx="sum")

    def update(
        self,
        values: torch.Tensor,
        columns: Columns = slice(None),
        rows: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
    ) -> None:
        """Add one observation per cell, on the device.

        Args:
            values: ``[rows, columns]`` values for the selected cells.
            columns: which statistics ``values`` holds (a slice or column indices).
            rows: layer indices of ``values``' rows (default: every layer, in order).
            valid: optional boolean mask broadcastable to ``values``: cells where it is false are
                not observed (a layer that did not run, a ratio with a zero denominator).
        """
        cols = columns if isinstance(columns, slice) else list(columns)
        at: tuple[Any, ...]
        if rows is None:
            at = (slice(None), cols)
        else:
            at = (rows, cols) if isinstance(cols, slice) else (rows[:, None], cols)
        if valid is None:
            self.total[at] += values
            self.peak[at] = torch.maximum(self.peak[at], values)
            self.count[at] += 1
            return
        valid = valid.expand_as(values)
        self.total[at] += torch.where(valid, values, 0.0)
        self.peak[at] = torch.where(valid, torch.maximum(self.peak[at], values), self.peak[at])
        self.count[at] += valid

    def compute(self) -> torch.Tensor:
        """``[4, layers, stats]``: mean, peak, total and count (synced across ranks)."""
        mean = torch.where(self.count > 0, self.total / self.count.clamp_min(1), torch.nan)
        peak = torch.where(self.count > 0, self.peak, torch.nan)
        return torch.stack([mean, peak, self.total, self.count])

    def result(self) -> LayerStats:
        """:meth:`compute`, copied to the host once, as a :class:`LayerStats`."""
        if self._update_count == 0:
            nan = np.full((len(self.layers), len(self.stats)), np.nan)
            zero = np.zeros_like(nan)
            return LayerStats(self.layers, self.stats, nan, nan, zero, zero)
        mean, peak, total, count = self.compute().cpu().double().numpy()
        return LayerStats(self.layers, self.stats, mean, peak, total, count)
