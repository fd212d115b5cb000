"""``LayerStates``: the device states of a :class:`~lightning_hooks.core.stats.stat.LayerStat`.

Each state is declared with a dtype and a reduction; a layer's row is made the first time it is
seen (every state grown by one row, or by a run of entries per unit), the ranks align their rows
before a reduce, and every state is reduced across ranks in ONE packed collective. What the
states measure, and what becomes of them on the host, is :class:`LayerStat`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torchmetrics import Metric

from lightning_hooks.core.stats.windows import Reduce, StateSpec, all_pool, pack_dtype

__all__ = ["LayerStates"]


class LayerStates(Metric):
    """Per-layer device states on torchmetrics' state machinery: declared, grown a row at a time,
    aligned and reduced across ranks in one collective, reset to their identities.

    The base of :class:`~lightning_hooks.core.stats.stat.LayerStat`, which adds the hooks that
    feed the states and the host windows they are read into; a subclass defines ``update``.

    Example:
        >>> class Seen(LayerStates):
        ...     def update(self) -> None: ...
        >>> states = Seen()
        >>> states.add_layer_state("seen", reduce="sum")
        >>> states.add_unit_state("alive", reduce="max", dtype=torch.bool)
        >>> states.row("encoder"), states.row("head", units=3), states.layers
        (0, 1, ('encoder', 'head'))
        >>> states.seen.shape, states.alive.shape, states.unit_slice(1)
        (torch.Size([2]), torch.Size([3]), slice(0, 3, None))
    """

    full_state_update = False

    def __init__(self) -> None:
        super().__init__(sync_on_compute=True, compute_with_cache=False)
        self.specs: dict[str, StateSpec] = {}
        self.rows: dict[str, int] = {}
        self.units: list[int] = []
        self._starts: list[int] = []  # where each row's entries begin in the per-unit states
        self._aligned = 0  # rows every rank has, in the same order (see align_rows)

    # --- declaring states -------------------------------------------------------------------

    def add_layer_state(
        self,
        name: str,
        *,
        reduce: Reduce,
        width: Sequence[int] = (),
        dtype: torch.dtype = torch.float64,
        fill: float | None = None,
    ) -> None:
        """Declare a ``[rows, *width]`` state, pooled across ranks with ``reduce``."""
        self._declare(StateSpec(name, reduce, dtype, tuple(width), "layer", fill))

    def add_unit_state(
        self,
        name: str,
        *,
        reduce: Reduce,
        dtype: torch.dtype = torch.float64,
        fill: float | None = None,
    ) -> None:
        """Declare a flat state holding ``units`` entries per row (see :meth:`unit_slice`)."""
        self._declare(StateSpec(name, reduce, dtype, (), "unit", fill))

    def add_global_state(
        self,
        name: str,
        *,
        reduce: Reduce,
        width: Sequence[int] = (1,),
        dtype: torch.dtype = torch.float64,
    ) -> None:
        """Declare one ``[*width]`` state for the whole model (a step count, a step time)."""
        self._declare(StateSpec(name, reduce, dtype, tuple(width), "global"))

    def _declare(self, spec: StateSpec) -> None:
        self.specs[spec.name] = spec
        self.add_state(spec.name, self._fresh(spec, 0, self.device), dist_reduce_fx=None)

    @staticmethod
    def _fresh(spec: StateSpec, rows: int, device: torch.device) -> torch.Tensor:
        shape = {"layer": (rows, *spec.width), "unit": (rows,), "global": spec.width}[spec.kind]
        mps_double = device.type == "mps" and spec.dtype == torch.float64
        dtype = torch.float32 if mps_double else spec.dtype  # MPS has no float64
        return torch.full(shape, spec.identity, dtype=dtype, device=device)

    # --- rows ------------------------------------------------------------------------------

    @property
    def layers(self) -> tuple[str, ...]:
        """Row names, in the order they were created."""
        return tuple(self.rows)

    def row(self, name: str, units: int = 0) -> int:
        """The row of ``name``, created (every state grown) the first time, with ``units`` units.

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
        index = self.rows[name] = len(self.rows)
        self._starts.append(sum(self.units))
        self.units.append(units)
        for spec in self.specs.values():
            if spec.kind != "global":
                old: torch.Tensor = getattr(self, spec.name)
                new = self._fresh(spec, units if spec.kind == "unit" else 1, old.device)
                setattr(self, spec.name, torch.cat([old, new]))
        return index

    def _drop_rows(self, device: torch.device) -> None:
        """Forget every row: each state made anew, with no rows, on ``device``."""
        self.rows, self.units, self._starts = {}, [], []
        self._aligned = 0
        for spec in self.specs.values():
            setattr(self, spec.name, self._fresh(spec, 0, device))

    @property
    def rows_grew(self) -> bool:
        """Whether rows were made since the ranks last aligned them (:meth:`align_rows`)."""
        return len(self.rows) != self._aligned

    def new_rows(self) -> list[tuple[str, int]]:
        """``(name, units)`` of the rows made since the ranks last aligned them, in order; what
        the hooks still hold is flushed into the states first (it may make a row, and it is
        held by row number: it must be in its row before :meth:`align_rows` moves the rows)."""
        self.flush()
        return [(name, self.units[i]) for name, i in self.rows.items() if i >= self._aligned]

    def align_rows(self, new: Sequence[Sequence[tuple[str, int]]]) -> None:
        """Give this rank the rows every rank made since the last alignment (``new``: each
        rank's :meth:`new_rows`, by rank), in one order on every rank: the rows aligned before,
        then the new ones by rank and, within a rank, in the order it made them.

        Rows are made when a layer is first observed: a module that runs on some ranks only
        (an expert that got no tokens, a branch the data skips) would otherwise leave the
        ranks with different states, and the one collective would fail or hang. This rank's
        new rows move to their place with what they measured; the others start empty.

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
            kept = {n: self._row_values(self.rows[n]) for n, _ in mine}
            self._truncate(self._aligned)
            for name, units in order.items():
                row = self.row(name, units)
                if name in kept:
                    self._set_row_values(row, kept[name])
        self._aligned = len(self.rows)

    def _row_values(self, row: int) -> dict[str, torch.Tensor]:
        """Every per-row state's entries of ``row`` (copies)."""
        out = {}
        for spec in self.specs.values():
            state: torch.Tensor = getattr(self, spec.name)
            if spec.kind == "layer":
                out[spec.name] = state[row].clone()
            elif spec.kind == "unit":
                out[spec.name] = state[self.unit_slice(row)].clone()
        return out

    def _set_row_values(self, row: int, values: dict[str, torch.Tensor]) -> None:
        for name, value in values.items():
            state: torch.Tensor = getattr(self, name)
            if self.specs[name].kind == "layer":
                state[row] = value
            else:
                state[self.unit_slice(row)] = value

    def _truncate(self, rows: int) -> None:
        """Keep the first ``rows`` rows (every per-row state cut to them)."""
        units = sum(self.units[:rows])
        for spec in self.specs.values():
            if spec.kind != "global":
                state: torch.Tensor = getattr(self, spec.name)
                setattr(self, spec.name, state[: units if spec.kind == "unit" else rows].clone())
        self.rows = {n: i for n, i in self.rows.items() if i < rows}
        self.units, self._starts = self.units[:rows], self._starts[:rows]

    def unit_slice(self, row: int) -> slice:
        """Where ``row``'s entries lie in a per-unit state."""
        start = self._starts[row]
        return slice(start, start + self.units[row])

    # --- reduce and reset ------------------------------------------------------------------

    def compute(self) -> Any:
        """Every state by name, on the device (reduced across ranks inside ``Metric.compute``)."""
        return {name: getattr(self, name) for name in self.specs}

    def flush(self) -> None:
        """Move values kept on the host into the states (override; called before a reduce)."""

    def _sync_dist(self, dist_sync_fn: Any = None, process_group: Any = None) -> None:
        # One all-gather of every state packed together, whatever their number and dtypes.
        names = list(self.specs)
        tensors = [getattr(self, n) for n in names]
        reduces = [self.specs[n].reduce for n in names]
        pooled = all_pool(tensors, reduces, pack_dtype(self.device), process_group)
        for name, tensor in zip(names, pooled, strict=True):
            setattr(self, name, tensor)

    def _reduced(self) -> tuple[torch.Tensor, dict[str, torch.Size]]:
        """Every state of the window reduced across ranks (one collective), packed in one."""
        self.flush()
        names = list(self.specs)
        dtype = pack_dtype(self.device)
        with self.sync_context():
            tensors = [getattr(self, n) for n in names]
            shapes = {n: t.shape for n, t in zip(names, tensors, strict=True)}
            parts = [t.reshape(-1).to(dtype) for t in tensors]
            packed = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=self.device)
        return packed, shapes

    def _reset_window(self) -> None:
        """Start a new window on the device: every state but ``"same"`` ones to its identity."""
        for spec in self.specs.values():
            if spec.reduce != "same":
                getattr(self, spec.name).fill_(spec.identity)
        self._update_count = 0
        self._cache = None
        self._is_synced = False
