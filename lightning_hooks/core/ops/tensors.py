"""Tensor helpers for the hooks: which forwards count, scratch memory, pieces and held outputs."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from lightning_hooks import internals

__all__ = [
    "DEVICE_PIECE",
    "Pending",
    "Workspace",
    "foreach_norm",
    "is_training_forward",
    "iter_float_tensors",
    "logsumexp_rows",
    "piece_size",
    "row_index",
]

DEVICE_PIECE = 1 << 24  # elements read at a time off the CPU (float32 counts stay exact)

foreach_norm = internals.foreach_norm
"""``foreach_norm(tensors, ord=2, dtype=None)``: each tensor's norm, in one multi-tensor pass
(:data:`lightning_hooks.internals.foreach_norm`)."""


def piece_size(device: torch.device, cpu: int) -> int:
    """Return the elements per piece of a reading pass.

    Args:
        device: the device the pass reads on.
        cpu: the piece size on the CPU.

    Returns:
        ``cpu`` on the CPU, :data:`DEVICE_PIECE` elsewhere.
    """
    return cpu if device.type == "cpu" else max(cpu, DEVICE_PIECE)


class Workspace:
    """What a reader of tensors reuses from one step to the next.

    It holds flat scratch buffers per dtype and device, grown as needed (fresh ones page-fault), and
    the stacks of its grouped reads.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self.groupings: dict[tuple[object, ...], Any] = {}
        """The stacks of a grouped read (:func:`~.grouped_norms.cpu_grouping`), by the shapes and
        dtypes of its tensors: made once per reader, at most 16 kept."""

    def get(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Return a flat scratch tensor of ``numel`` entries (its contents are garbage).

        Args:
            numel: the entries needed.
            dtype: the scratch tensor's dtype; each dtype has its own buffer.
            device: the device the scratch tensor is on; each device has its own buffer.

        Returns:
            A view of ``numel`` entries of the buffer for ``dtype`` and ``device``.
        """
        buffer = self._buffers.get((dtype, device))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[(dtype, device)] = buffer
        return buffer[:numel]


def is_training_forward(module: nn.Module) -> bool:
    """Return whether a hook on ``module`` runs in a training forward that counts.

    A forward counts unless it is validation or the sanity check (grad disabled), or an
    activation-checkpoint recompute.

    Args:
        module: the module whose hook asks.

    Returns:
        Whether the forward is one that counts.

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> is_training_forward(layer)
        True
        >>> with torch.no_grad():
        ...     is_training_forward(layer)
        False
    """
    # Not the module's own training flag: a submodule the user put in eval mode (a frozen
    # backbone) runs in the training forward too, and counts.
    if not torch.is_grad_enabled():
        return False
    if internals.is_compiling():
        # Dynamo cannot trace the graph-task query (a graph break per hooked module), and a
        # compiled forward's hooks never run again in backward: recomputation is in the graph.
        return True
    return internals.current_graph_task_id() == -1  # not a checkpoint recompute in backward


def iter_float_tensors(output: object, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every float tensor in a nested output with its suffix.

    Args:
        output: a module's output: a tensor, or tuples, lists and dicts of them.
        prefix: the suffix of ``output`` itself, which its items' suffixes extend.

    Yields:
        ``(suffix, tensor)`` of every float tensor: ``.0``, ``.key`` or ``""``.

    Example:
        >>> out = (torch.zeros(1), {"h": torch.ones(1), "n": 3}, None)
        >>> [suffix for suffix, _ in iter_float_tensors(out)]
        ['.0', '.1.h']
    """
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        yield prefix, output
    elif isinstance(output, list | tuple):
        for i, item in enumerate(output):
            yield from iter_float_tensors(item, f"{prefix}.{i}")
    elif isinstance(output, Mapping):
        for key, item in output.items():
            yield from iter_float_tensors(item, f"{prefix}.{key}")


LOGSUMEXP_PIECE = 1 << 19  # elements converted to float32 at a time on the CPU (2 MiB)


@torch.no_grad()
def logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """Return ``torch.logsumexp(x.float(), dim=-1)`` without a float32 copy of all of ``x``.

    Whole rows are converted a :func:`piece_size` piece at a time (an LM head's bf16 logits).

    Args:
        x: the rows, reduced over the last dimension.

    Returns:
        The float32 log-sum-exp of each row.
    """
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    step = max(1, piece_size(x.device, LOGSUMEXP_PIECE) // max(width, 1))
    for start in range(0, rows.shape[0], step):
        part = rows[start : start + step].float()
        torch.logsumexp(part, dim=-1, out=out[start : start + step])
    return out.view(x.shape[:-1])


def row_index(values: list[int], device: torch.device) -> torch.Tensor:
    """Return ``values`` as a ``long`` tensor on ``device``, without a host sync.

    Args:
        values: the row numbers.
        device: the device the index is used on.

    Returns:
        The index tensor.
    """
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=torch.long, pin_memory=pinned).to(device, non_blocking=pinned)


K = TypeVar("K", bound=Hashable)

_HELD = 1 << 22  # elements held for their batches, at most: a drain is due beyond
_INDICES = 64  # row patterns whose device index is kept


class Pending(Generic[K]):
    """Snapshots by group, with the rows they go to and a cache of their device indices."""

    def __init__(self) -> None:
        self._groups: dict[K, tuple[list[int], list[torch.Tensor]]] = {}
        self._held = 0
        self._indices: dict[tuple[object, ...], torch.Tensor] = {}

    def add(self, key: K, row: int, snapshot: torch.Tensor) -> bool:
        """Store ``snapshot`` for ``row`` in ``key``'s group.

        Args:
            key: the group the snapshot is stacked with.
            row: the row the snapshot goes to.
            snapshot: the tensor held until the next drain.

        Returns:
            ``True`` when a drain is due.
        """
        rows, snapshots = self._groups.setdefault(key, ([], []))
        rows.append(row)
        snapshots.append(snapshot)
        self._held += snapshot.numel()
        return self._held > _HELD

    def __len__(self) -> int:  # the snapshots held
        """Return the number of snapshots held."""
        return sum(len(rows) for rows, _ in self._groups.values())

    def drain(self) -> Iterator[tuple[K, list[int], torch.Tensor]]:
        """Yield each group and drop what is held.

        Yields:
            Each group as ``(key, rows, snapshots stacked)``, in order, dropped as given.
        """
        groups = self._groups
        self._groups = {}
        self._held = 0
        for key, (rows, snapshots) in groups.items():
            yield key, rows, torch.stack(snapshots)

    def clear(self) -> None:
        """Drop what is held (a step cut short)."""
        self._groups = {}
        self._held = 0

    def index(
        self, rows: list[int], device: torch.device, spans: Sequence[range] | None = None
    ) -> torch.Tensor:
        """Return ``rows`` as a device index, kept for the next step's same rows.

        Args:
            rows: the row numbers.
            device: the device the index is used on.
            spans: a range of positions per row; when given, the index lists every row's
                positions in turn.

        Returns:
            The ``long`` index on ``device``.
        """
        # keyed by the device too: a tracker attached again may be on another one
        key = (device, *rows) if spans is None else (device, None, *spans)
        index = self._indices.get(key)
        if index is None:
            if len(self._indices) >= _INDICES:  # a forward whose calls vary: start over
                self._indices.clear()
            values = rows if spans is None else [i for span in spans for i in span]
            index = row_index(values, device)
            self._indices[key] = index
        return index
