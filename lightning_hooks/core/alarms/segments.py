"""Per-parameter gradient norms folded into per-layer rows on the host (the quiet step's fold).

On a quiet step the sentinel copies one ``[parameters]`` vector of L2 norms to the host (one
multi-tensor norm, one stack, one copy), and the rows the rules read are made here, in numpy:
no segment kernels on the device, no per-layer Python, a handful of numpy calls into buffers
made once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["HostSegments"]


class HostSegments:
    """Which row each parameter's norm belongs to, on the host.

    Args:
        owner: the layer row of each parameter (``0 .. layers - 1``), in parameter order.
        layers: the number of layer rows (the global row comes after them).
        unique: positions the global row sums over (a tied parameter once, in order).

    Example:
        >>> seg = HostSegments([0, 0, 1], 2, [0, 1, 2])
        >>> seg.fold(np.array([3.0, 4.0, 12.0], dtype=np.float32)).tolist()
        [5.0, 12.0, 13.0]
    """

    def __init__(self, owner: Sequence[int], layers: int, unique: Sequence[int]) -> None:
        self.owner = np.asarray(owner, dtype=np.int64)
        self.layers = layers
        distinct = list(unique) == list(range(len(owner)))
        self.unique = None if distinct else np.asarray(unique, dtype=np.int64)
        # Parameters are grouped by layer (ParamLayout's order): each layer's run starts here,
        # and one ``reduceat`` sums them; any other order takes ``bincount``.
        starts = np.flatnonzero(np.diff(self.owner, prepend=-1))
        runs = len(starts) == layers and (self.owner[starts] == np.arange(layers)).all()
        self._starts = starts if runs and layers > 0 else None
        self._squares = np.zeros(len(owner), dtype=np.float64)
        self._rows = np.zeros(layers + 1, dtype=np.float64)
        self._out = np.zeros(layers + 1, dtype=np.float32)

    def fold(self, norms: np.ndarray) -> np.ndarray:
        """``[layers + 1]`` float32 L2 norms: each layer's parameters, then the global norm
        (squares summed in float64; NaN and Inf propagate). The array is reused by the next
        call."""
        squares, rows = self._squares, self._rows
        np.multiply(norms, norms, out=squares, dtype=np.float64)
        if self._starts is not None:
            np.add.reduceat(squares, self._starts, out=rows[:-1])
        else:
            rows[:-1] = np.bincount(self.owner, weights=squares, minlength=self.layers)
        rows[-1] = squares.sum() if self.unique is None else squares[self.unique].sum()
        np.sqrt(rows, out=rows)
        self._out[...] = rows
        return self._out
