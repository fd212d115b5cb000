"""The per-layer values of every epoch of a fit, kept for a layer-by-epoch heatmap.

The values are saved in checkpoints, so that a resumed fit also draws the epochs before the
checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["EpochColumns"]


class EpochColumns:
    """One column of per-layer values per epoch, for each statistic of a heatmap.

    Example:
        >>> columns = EpochColumns()
        >>> columns.add(0, ["a", "b"], {"mean": np.array([1.0, 2.0])})
        >>> columns.add(1, ["b"], {"mean": np.array([3.0])})
        >>> layers, epochs, grid = columns.grid("mean")
        >>> layers, epochs, grid.tolist()
        (['a', 'b'], [0, 1], [[1.0, nan], [2.0, 3.0]])
    """

    def __init__(self) -> None:
        self._epochs: list[tuple[int, tuple[str, ...], dict[str, np.ndarray]]] = []

    def __len__(self) -> int:
        """Return how many epochs are kept."""
        return len(self._epochs)

    def clear(self) -> None:
        """Forget every epoch (a new fit draws a new heatmap)."""
        self._epochs = []

    def add(self, epoch: int, layers: Sequence[str], columns: Mapping[str, np.ndarray]) -> None:
        """Keep an epoch's values: for each statistic, one value per layer.

        The values are copied, so a buffer the caller reuses does not change them.

        Args:
            epoch: the epoch the values belong to, a column of the grid.
            layers: the layers the values are of, in the order of each statistic's values.
            columns: each statistic's values, one per layer of ``layers``, by statistic.
        """
        copied = {
            stat: np.asarray(values, dtype=np.float64).copy() for stat, values in columns.items()
        }
        self._epochs.append((int(epoch), tuple(layers), copied))

    def grid(self, stat: str) -> tuple[list[str], list[int], np.ndarray]:
        """Return the layers, the epochs, and a statistic's values as a ``[layers, epochs]`` grid.

        The layers are in the order first seen; the grid is NaN where a layer had no value in an
        epoch.

        Args:
            stat: the statistic whose values fill the grid, as :meth:`add` was given it.

        Returns:
            The layers, the epochs, and the grid.
        """
        layers = list(dict.fromkeys(layer for _, names, _ in self._epochs for layer in names))
        epochs = [epoch for epoch, _, _ in self._epochs]
        grid = np.full((len(layers), len(epochs)), np.nan)
        for col, (_, names, columns) in enumerate(self._epochs):
            rows = [layers.index(name) for name in names]
            grid[rows, col] = columns[stat]
        return layers, epochs, grid

    def host_state(self) -> dict[str, Any]:
        """Return every epoch's columns as plain lists, to be saved in checkpoints."""
        epochs = [
            {
                "epoch": epoch,
                "layers": list(names),
                "columns": {k: v.tolist() for k, v in cols.items()},
            }
            for epoch, names, cols in self._epochs
        ]
        return {"epochs": epochs}

    def load_host_state(self, state: dict[str, Any]) -> None:
        """Continue from the epochs a checkpoint saved, replacing any kept.

        Args:
            state: what :meth:`host_state` saved, as read from the checkpoint.
        """
        self.clear()
        for saved in state.get("epochs", []):
            columns = {k: np.asarray(v, dtype=np.float64) for k, v in saved["columns"].items()}
            self.add(saved["epoch"], saved["layers"], columns)
