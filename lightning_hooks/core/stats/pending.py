"""Small outputs held from their hooks to the end of the step, measured a batch per shape.

A sampled forward calls a statistic's hook once per watched module. Measuring each output where
it is seen costs a handful of ops and some Python per module; most outputs of a model are small
enough that this per-call cost, not their size, is what the sampled step pays. A tracker hands
each small output's snapshot to :class:`Pending` instead, and measures each group (same shape,
dtype and device, and whatever else its key holds) as one stacked tensor when it flushes.
Which outputs are small is the tracker's choice (:data:`~..kernels.feature_stats.STACKED`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import Generic, TypeVar

import torch

from lightning_hooks.core.kernels.tensors import row_index

__all__ = ["Pending"]

K = TypeVar("K", bound=Hashable)

_HELD = 1 << 22  # elements held for their batches, at most: a flush is due beyond
_INDICES = 64  # row patterns whose device index is kept


class Pending(Generic[K]):
    """Snapshots by group, with the rows they go to, and a cache of the rows' device indices.

    Example:
        >>> pending: Pending[tuple[str]] = Pending()
        >>> pending.add(("a",), 3, torch.ones(2))
        False
        >>> pending.add(("a",), 1, torch.zeros(2))
        False
        >>> len(pending)
        2
        >>> [(key, rows, stacked.tolist()) for key, rows, stacked in pending.drain()]
        [(('a',), [3, 1], [[1.0, 1.0], [0.0, 0.0]])]
        >>> list(pending.drain())
        []
    """

    def __init__(self) -> None:
        self._groups: dict[K, tuple[list[int], list[torch.Tensor]]] = {}
        self._held = 0
        self._indices: dict[tuple[object, ...], torch.Tensor] = {}

    def add(self, key: K, row: int, snapshot: torch.Tensor) -> bool:
        """Hold ``snapshot`` for ``row`` in ``key``'s group; ``True`` when a flush is due."""
        rows, snapshots = self._groups.setdefault(key, ([], []))
        rows.append(row)
        snapshots.append(snapshot)
        self._held += snapshot.numel()
        return self._held > _HELD

    def __len__(self) -> int:
        """The snapshots held."""
        return sum(len(rows) for rows, _ in self._groups.values())

    def drain(self) -> Iterator[tuple[K, list[int], torch.Tensor]]:
        """Each group as ``(key, rows, snapshots stacked)``, in the order the groups and their
        calls were first seen; the groups are dropped as they are given."""
        groups, self._groups, self._held = self._groups, {}, 0
        for key, (rows, snapshots) in groups.items():
            yield key, rows, torch.stack(snapshots)

    def clear(self) -> None:
        """Drop what is held (a step cut short)."""
        self._groups, self._held = {}, 0

    def index(
        self, rows: list[int], device: torch.device, spans: Sequence[range] | None = None
    ) -> torch.Tensor:
        """``rows`` as a device index, kept for the next step's same rows; with ``spans`` (a
        range of positions per row), every row's positions in turn.

        Example:
            >>> Pending().index([2, 0], torch.device("cpu"), spans=[range(4, 6), range(0, 2)])
            tensor([4, 5, 0, 1])
        """
        # keyed by the device too: a tracker attached again may be on another one
        key = (device, *rows) if spans is None else (device, None, *spans)
        index = self._indices.get(key)
        if index is None:
            if len(self._indices) >= _INDICES:  # a forward whose calls vary: start over
                self._indices.clear()
            values = rows if spans is None else [i for span in spans for i in span]
            index = self._indices[key] = row_index(values, device)
        return index
