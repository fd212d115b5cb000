"""Hold the states of a per-layer statistic, reduced across ranks in one packed collective."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from typing_extensions import Self

from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.transport import all_gather_stacked, is_distributed

__all__ = ["Kind", "Reduce", "RowStates", "StateSpec", "unpack"]

Reduce = Literal["sum", "max", "min", "same"]  # "same": values every rank shares (bin edges)
Kind = Literal["layer", "unit", "global"]
"""Where a state's entries live: a row per layer, a run per row's units, or one for the model."""


@dataclass(frozen=True)
class StateSpec:
    """Describe one declared state (see :data:`Kind`)."""

    name: str
    reduce: Reduce
    dtype: torch.dtype
    width: tuple[int, ...] = ()
    kind: Kind = "layer"
    fill: float | None = None

    @property
    def identity(self) -> float:
        """The value of a fresh (or reset) entry."""
        if self.fill is not None:
            return self.fill
        if self.reduce in ("sum", "same"):
            return 0.0
        if self.dtype.is_floating_point:
            return -torch.inf if self.reduce == "max" else torch.inf
        if self.dtype == torch.bool:
            return float(self.reduce != "max")
        info = torch.iinfo(self.dtype)
        return float(info.min if self.reduce == "max" else info.max)


def _dtype_on(spec: StateSpec, device: torch.device) -> torch.dtype:
    """Return ``spec``'s dtype on ``device``: float64 is float32 on MPS, which has no float64."""
    return torch.float32 if device.type == "mps" and spec.dtype == torch.float64 else spec.dtype


def unpack(host: np.ndarray, shapes: dict[str, torch.Size]) -> dict[str, np.ndarray]:
    """Unpack the packed states ``host`` into float64 arrays by name (a copy).

    Args:
        host: the packed states, on the host.
        shapes: each state's shape by name, in packing order.

    Returns:
        Each state as a float64 array, in ``shapes``' order.
    """
    flat = np.array(host, dtype=np.float64)
    out = {}
    start = 0
    for name, shape in shapes.items():  # math.prod of a torch.Size: no array made per state
        end = start + math.prod(shape)
        out[name] = flat[start:end].reshape(shape)
        start = end
    return out


_POOL: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {  # the ranks' copies, stacked
    "sum": lambda ranks: ranks.sum(0),
    "max": lambda ranks: ranks.amax(0),
    "min": lambda ranks: ranks.amin(0),
    "same": lambda ranks: ranks[0],
}


class RowStates:
    """Hold per-layer states: declared, grown a row at a time, aligned and reduced across ranks."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.specs: dict[str, StateSpec] = {}
        self.rows: dict[str, int] = {}
        self.units: list[int] = []
        self._starts: list[int] = []  # where each row's entries begin in the per-unit states
        self._aligned = 0  # rows every rank has, in the same order (see align_rows)
        self._counts: dict[str, dict[int, int]] = {}  # host-side counts by state (see tally)

    @named_arguments
    def add_layer_state(  # noqa: PLR0913 (torchmetrics' add_state: one keyword per option)
        self,
        name: str,
        *,
        reduce: Reduce,
        width: Sequence[int] = (),
        dtype: torch.dtype = torch.float64,
        fill: float | None = None,
        kind: Kind = "layer",
    ) -> None:
        """Declare a state pooled across ranks by ``reduce``, ``[rows, *width]``.

        With ``kind="unit"`` there are ``units`` entries per row (:meth:`unit_slice`), with
        ``"global"`` one ``[*width]`` for the whole model (a step count).

        Args:
            name: the state's name, the attribute it is kept under.
            reduce: how the ranks' copies pool: ``"sum"``, ``"max"``, ``"min"``, or ``"same"``
                for values every rank shares (bin edges).
            width: the shape of a row's entry (``()``: a number).
            dtype: the state's dtype (float64 is float32 on MPS).
            fill: a fresh entry's value (``None``: the identity of ``reduce``).
            kind: where the entries live (see :data:`Kind`).

        Raises:
            TypeError: a keyword that is not one of these (the error names the closest), or no
                ``reduce``.
        """
        spec = StateSpec(
            name=name, reduce=reduce, dtype=dtype, width=tuple(width), kind=kind, fill=fill
        )
        self.specs[name] = spec
        setattr(self, name, self._fresh(spec, 0, self.device))

    def to(self, device: torch.device) -> Self:
        """Move every state to ``device`` (a float64 state is float32 on MPS).

        Args:
            device: the device the states move to.

        Returns:
            ``self``.
        """
        self.device = torch.device(device)
        for spec in self.specs.values():
            state: torch.Tensor = getattr(self, spec.name)
            setattr(self, spec.name, state.to(self.device, _dtype_on(spec, self.device)))
        return self

    @staticmethod
    def _fresh(spec: StateSpec, rows: int, device: torch.device) -> torch.Tensor:
        """Return a state of ``rows`` rows on ``device``, every entry its identity."""
        shape = {"layer": (rows, *spec.width), "unit": (rows,), "global": spec.width}[spec.kind]
        return torch.full(shape, spec.identity, dtype=_dtype_on(spec, device), device=device)

    @property
    def layers(self) -> tuple[str, ...]:
        """Row names, in order."""
        return tuple(self.rows)

    def row(self, name: str, units: int = 0) -> int:
        """Return the row of ``name``, made (every state grown) the first time.

        Args:
            name: the row's name, a module's qualified name.
            units: the row's entries in a per-unit state, fixed when the row is made.

        Returns:
            The row's index.

        Raises:
            ValueError: the row exists with another number of units.
        """
        index = self.rows.get(name)
        if index is not None:
            if self.units[index] != units:
                raise ValueError(
                    f"{type(self).__name__}: layer {name!r} had {self.units[index]} units, "
                    f"now {units}; pass the unit dimension whose size does not change"
                )
            return index
        index = len(self.rows)
        self.rows[name] = index
        self._starts.append(sum(self.units))
        self.units.append(units)
        for spec in self.specs.values():
            if spec.kind != "global":
                old: torch.Tensor = getattr(self, spec.name)
                new = self._fresh(spec, units if spec.kind == "unit" else 1, old.device)
                setattr(self, spec.name, torch.cat([old, new]))
        return index

    def _drop_rows(self, device: torch.device) -> None:
        """Forget every row, the states emptied on ``device``."""
        self.rows = {}
        self.units = []
        self._starts = []
        self._aligned = 0
        self._counts = {}
        for spec in self.specs.values():
            setattr(self, spec.name, self._fresh(spec, 0, device))

    @property
    def rows_grew(self) -> bool:
        """Say whether rows were made since :meth:`align_rows`.

        Returns:
            Whether rows were made.
        """
        return len(self.rows) != self._aligned

    def new_rows(self) -> list[tuple[str, int]]:
        """Return the rows made since the last alignment (drains first).

        Returns:
            ``(name, units)`` of each new row.
        """
        self.drain()
        return [(name, self.units[i]) for name, i in self.rows.items() if i >= self._aligned]

    def align_rows(self, new: Sequence[Sequence[tuple[str, int]]]) -> None:
        """Give every rank the same rows, in rank order.

        Thus a module run on some ranks only does not hang the collective.

        Args:
            new: each rank's :meth:`new_rows`, in rank order.

        Raises:
            ValueError: two ranks made the same layer's row with different numbers of units.
        """
        order: dict[str, int] = {}
        for rank_rows in new:
            for name, units in rank_rows:
                if order.setdefault(name, units) != units:
                    raise ValueError(
                        f"{type(self).__name__}: layer {name!r} has {order[name]} units on one "
                        f"rank and {units} on another"
                    )
        mine = self.new_rows()
        if [n for n, _ in mine] != list(order):
            per_row = [spec for spec in self.specs.values() if spec.kind != "global"]
            kept = {n: [self._entries(s, self.rows[n]).clone() for s in per_row] for n, _ in mine}
            aligned = self._aligned
            entries = sum(self.units[: self._aligned])
            for spec in per_row:  # back to the aligned rows, then the new ones in rank order
                end = entries if spec.kind == "unit" else aligned
                setattr(self, spec.name, getattr(self, spec.name)[:end].clone())
            self.rows = {n: i for n, i in self.rows.items() if i < aligned}
            self.units = self.units[:aligned]
            self._starts = self._starts[:aligned]
            for name, units in order.items():
                row = self.row(name, units)
                for spec, value in zip(per_row, kept.get(name, ()), strict=False):
                    self._entries(spec, row).copy_(value)
        self._aligned = len(self.rows)

    def _entries(self, spec: StateSpec, row: int) -> torch.Tensor:
        """Return ``row``'s entries of state ``spec``: its row, or its slice of a per-unit state."""
        state: torch.Tensor = getattr(self, spec.name)
        return state[row] if spec.kind == "layer" else state[self.unit_slice(row)]

    def unit_slice(self, row: int) -> slice:
        """Return where ``row``'s entries lie in a per-unit state.

        Args:
            row: the row's index.

        Returns:
            The slice of the row's entries.
        """
        start = self._starts[row]
        return slice(start, start + self.units[row])

    def tally(self, name: str, row: int, n: int = 1) -> None:
        """Add ``n`` to state ``name``'s ``row`` on the host, moved in at :meth:`drain`.

        Args:
            name: the state counted into.
            row: the row counted into.
            n: the count added.
        """
        counts = self._counts.setdefault(name, {})
        counts[row] = counts.get(row, 0) + n

    def drain(self) -> None:
        """Move what the hooks hold into the states; runs before every reduce.

        An override moves its own, then calls this.
        """
        for name, counts in self._counts.items():
            if counts:
                state: torch.Tensor = getattr(self, name)
                rows = torch.tensor(list(counts), device=state.device)
                added = torch.tensor(list(counts.values()), dtype=state.dtype)
                state.index_add_(0, rows, added.to(state.device))
                counts.clear()

    def _reduced(self) -> tuple[torch.Tensor, dict[str, torch.Size]]:
        """Return every state since the last logging step, reduced across ranks, packed in one.

        The reduce is one collective.
        """
        self.drain()
        dtype = torch.float32 if self.device.type == "mps" else torch.float64  # MPS: no float64
        tensors = [getattr(self, n) for n in self.specs]
        shapes = {n: t.shape for n, t in zip(self.specs, tensors, strict=True)}
        parts = [t.reshape(-1).to(dtype) for t in tensors]
        packed = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=self.device)
        if is_distributed():
            ranks = all_gather_stacked(packed)
            offset = 0
            for i, (tensor, spec) in enumerate(zip(tensors, self.specs.values(), strict=True)):
                part = ranks[:, offset : offset + tensor.numel()]
                offset += tensor.numel()
                parts[i] = _POOL[spec.reduce](part).to(tensor.dtype).to(dtype)  # rounded as held
            packed = torch.cat(parts)
        return packed, shapes

    def _reset_window(self) -> None:
        """Start the next logging step: every state but ``"same"`` ones back to its identity."""
        for spec in self.specs.values():
            if spec.reduce != "same":
                getattr(self, spec.name).fill_(spec.identity)
