"""Accumulation of ``[layers, stats]`` values over an epoch, read as a table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from lightning_hooks.core.checks import choice, named_arguments
from lightning_hooks.core.distributed import rank
from lightning_hooks.core.stats.stat import RowStates
from lightning_hooks.tags import family_tag

__all__ = ["LayerStatsAccumulator", "LayerTable", "Reduction"]

Columns = slice | Sequence[int]
Reduction = Literal["mean", "peak", "total", "count"]
"""A table's reductions of a statistic over the steps (:meth:`LayerTable.column`)."""


@named_arguments
@dataclass(frozen=True)
class LayerTable:
    """The result of an epoch: ``[layers, stats]`` arrays, ``NaN`` where never updated.

    Attributes:
        layers: layer names, one per row.
        stats: statistic names, one per column.
        mean: mean over the updates of each cell.
        peak: maximum over the updates of each cell.
        total: sum over the updates of each cell.
        count: number of updates of each cell.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from lightning_hooks import GradFlowTracker
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with GradFlowTracker(model, [opt]) as tracker:
        ...     model(torch.randn(16, 4)).pow(2).mean().backward()
        ...     measured = tracker.observe(opt)  # the norms an AlarmFeed reads
        ...     opt.step()
        ...     table = tracker.result()
        >>> table.layers
        ('0', '2', 'global')
        >>> table.column("grad_norm").shape, table.column("grad_norm", "count").tolist()
        ((3,), [1.0, 1.0, 1.0])
    """

    layers: tuple[str, ...]
    stats: tuple[str, ...]
    mean: np.ndarray
    peak: np.ndarray
    total: np.ndarray
    count: np.ndarray

    def column(self, stat: str, kind: Reduction = "mean") -> np.ndarray:
        """Return one statistic for every layer.

        Args:
            stat: the statistic's name, one of :attr:`stats`.
            kind: which reduction of it: ``"mean"``, ``"peak"``, ``"total"`` or ``"count"``.

        Returns:
            The statistic's column, one entry per layer.

        Raises:
            ValueError: ``stat`` or ``kind`` is not one of the allowed values.

        Example:
            >>> stats = LayerTable(("a",), ("norm",), *([np.ones((1, 1))] * 4))
            >>> stats.column("nrom")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: LayerTable.column(stat='nrom'): must be one of ('norm',), got 'nrom'...
        """
        choice("LayerTable.column", "stat", stat, self.stats)
        choice("LayerTable.column", "kind", kind, ("mean", "peak", "total", "count"))
        table: np.ndarray = getattr(self, kind)
        return table[:, self.stats.index(stat)]


class LayerStatsAccumulator(RowStates[LayerTable]):
    """Accumulates the sum, max and count of ``[layers, stats]`` values fed by :meth:`update`.

    It holds no hooks: the caller feeds every value.

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

    total: torch.Tensor
    peak: torch.Tensor
    count: torch.Tensor

    def __init__(self, layers: Sequence[str], stats: Sequence[str]) -> None:
        super().__init__()
        self.stats = tuple(stats)
        width = (len(self.stats),)
        self.add_layer_state("total", reduce="sum", width=width, dtype=torch.float32)
        self.add_layer_state("peak", reduce="max", width=width, dtype=torch.float32)
        self.add_layer_state("count", reduce="sum", width=width, dtype=torch.float32)
        for layer in layers:
            self.row(layer)

    def update(
        self,
        values: torch.Tensor,
        columns: Columns = slice(None),
        rows: torch.Tensor | slice | None = None,
        valid: torch.Tensor | None = None,
        *,
        replicated: bool = False,
    ) -> None:
        """Add one observation per cell (or per step and cell), in place, without a sync.

        Args:
            values: ``[rows, columns]``, or ``[steps, rows, columns]`` for several observations.
            columns: which statistics ``values`` holds (a slice or column indices).
            rows: layer indices of ``values``' rows, or a slice of them (default: every layer,
                in order); a slice adds into views of the states, with no gather and scatter.
            valid: boolean mask broadcastable to ``values``; false cells are not observed.
            replicated: ``values`` are identical on every rank: only rank 0 records them.
        """
        if replicated and rank() != 0:
            return
        cols = columns if isinstance(columns, slice) else list(columns)
        if isinstance(rows, torch.Tensor) and not isinstance(cols, slice):
            rows = rows[:, None]  # with a list of columns: the rows' cells, not a diagonal
        at = (slice(None) if rows is None else rows, cols)
        if values.dim() == 2:
            self._add_step(values, at, valid)
            return
        if values.shape[0] == 0:
            return
        mask = torch.ones_like(values, dtype=torch.bool) if valid is None else valid
        mask = mask.expand_as(values)
        self.total[at] += torch.where(mask, values, 0.0).sum(0)
        step_peak = torch.where(mask, values, -torch.inf).amax(0)
        self.peak[at] = torch.maximum(self.peak[at], step_peak)
        self.count[at] += mask.sum(0)

    def _add_step(
        self, values: torch.Tensor, at: tuple[Any, Any], valid: torch.Tensor | None
    ) -> None:
        """Add one observation per cell of ``at``.

        Three in-place ops when every cell is valid (a logging step's usual case), a masked value
        and a count by the mask otherwise.
        """
        if valid is None:
            self.total[at] += values
            self.peak[at] = torch.maximum(self.peak[at], values)
            self.count[at] += 1.0
            return
        valid = valid.expand_as(values)
        self.total[at] += torch.where(valid, values, 0.0)
        self.peak[at] = torch.maximum(self.peak[at], torch.where(valid, values, -torch.inf))
        self.count[at] += valid

    def summarize(self, states: dict[str, np.ndarray]) -> LayerTable:
        """Turn the reduced host states into the epoch's table.

        Args:
            states: the ``total``, ``peak`` and ``count`` states, reduced across ranks.

        Returns:
            The table; a cell never updated is ``NaN`` in ``mean`` and ``peak``.
        """
        total = states["total"]
        peak = states["peak"]
        count = states["count"]
        mean = np.where(count > 0, total / np.maximum(count, 1), np.nan)
        peak = np.where(count > 0, peak, np.nan)
        return LayerTable(self.layers, self.stats, mean, peak, total, count)

    def tags(self, result: LayerTable) -> dict[str, float]:
        """Return the mean of every observed cell, by tag.

        Args:
            result: the table :meth:`result` returned.

        Returns:
            The means, tagged ``{stat}/{layer}``.
        """
        return {
            family_tag(stat, layer): float(result.mean[i, j])
            for i, layer in enumerate(result.layers)
            for j, stat in enumerate(result.stats)
            if result.count[i, j] > 0
        }

    def host_state(self) -> dict[str, Any]:
        """Return the reduced host states, for a checkpoint (a collective, like :meth:`result`).

        Returns:
            The states with the rows and the statistic names.
        """
        return {**super().host_state(), "stats": list(self.stats)}

    def load_host_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`host_state` (see :meth:`RowStates.load_host_state`).

        Args:
            state: what :meth:`host_state` returned, from a checkpoint.

        Raises:
            ValueError: the state was saved for other layers or statistics.
        """
        layers = tuple(state["layers"])
        stats = tuple(state["stats"])
        if (layers, stats) != (self.layers, self.stats):
            raise ValueError(
                f"LayerStatsAccumulator.load_host_state: saved for layers={layers!r}, "
                f"stats={stats!r}; this one has layers={self.layers!r}, stats={self.stats!r}"
            )
        self.reset()
        super().load_host_state(state)
