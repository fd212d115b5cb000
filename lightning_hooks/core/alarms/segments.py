"""Per-parameter gradient norms folded into per-layer rows on the host (the quiet step's fold).

On a quiet step the sentinel copies one ``[parameters]`` vector of L2 norms to the host (one
multi-tensor norm, one stack, one copy), and the rows the rules read are made here, in numpy:
no segment kernels on the device, no per-layer Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["HostSegments"]


@dataclass(frozen=True)
class HostSegments:
    """Which row each parameter's norm belongs to, on the host.

    Attributes:
        owner: ``[parameters]`` the layer row of each (``0 .. layers - 1``).
        layers: the number of layer rows (the global row comes after them).
        unique: positions the global row sums over (a tied parameter once); ``None``: all.

    Example:
        >>> seg = HostSegments.of([0, 0, 1], 2, [0, 1, 2])
        >>> seg.fold(np.array([3.0, 4.0, 12.0], dtype=np.float32)).tolist()
        [5.0, 12.0, 13.0]
    """

    owner: np.ndarray
    layers: int
    unique: np.ndarray | None

    @classmethod
    def of(cls, owner: Sequence[int], layers: int, unique: Sequence[int]) -> HostSegments:
        """From host lists (``unique`` covering every position, in order, is stored as ``None``)."""
        distinct = list(unique) == list(range(len(owner)))
        kept = None if distinct else np.asarray(unique, dtype=np.int64)
        return cls(np.asarray(owner, dtype=np.int64), layers, kept)

    def fold(self, norms: np.ndarray) -> np.ndarray:
        """``[layers + 1]`` float32 L2 norms: each layer's parameters, then the global norm
        (squares summed in float64; NaN and Inf propagate)."""
        squares = np.square(norms, dtype=np.float64)
        rows = np.bincount(self.owner, weights=squares, minlength=self.layers)
        total = squares.sum() if self.unique is None else squares[self.unique].sum()
        out: np.ndarray = np.sqrt(np.append(rows, total)).astype(np.float32)
        return out
