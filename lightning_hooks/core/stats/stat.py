"""``LayerStat``: one per-layer statistic on torchmetrics' state machinery, the one pipeline.

A statistic declares its device states (dtype, reduction, one row per layer or a run of entries
per unit), its hooks (a forward hook by default: :meth:`LayerStat.observe`), how the reduced
states become a host result (:meth:`LayerStat.summarize`) and which tags that result gives
(:meth:`LayerStat.tags`). The base owns the rest: module selection, attach / remove through a
:class:`~lightning_hooks.core.hooks.registry.HookRegistry` (whose ``sampled`` flag gates the hooks),
ONE packed collective for every state, one device-to-host copy, reset and the checkpoint state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from torch import nn
from torchmetrics import Metric

from lightning_hooks.core.checks import module as check_module
from lightning_hooks.core.hooks.registry import HookOwner, HookRegistry
from lightning_hooks.core.hooks.selection import Selection
from lightning_hooks.core.kernels.tensors import is_training_forward
from lightning_hooks.core.stats.windows import (
    EpochWindows,
    Reduce,
    StateSpec,
    all_pool,
    pack_dtype,
    unpack,
)

__all__ = ["LayerStat", "Reduce", "StateSpec"]

R = TypeVar("R")


class LayerStat(Metric, HookOwner, Generic[R]):
    """Base of every per-layer statistic: states on the device, one collective, one copy.

    Subclasses declare states in ``__init__`` with :meth:`add_layer_state` /
    :meth:`add_unit_state`, implement :meth:`observe` (or override :meth:`hook_module` for other
    hooks), :meth:`summarize` and :meth:`tags`. Rows are created by :meth:`row` the first time a
    layer is observed (or up front), in execution order; a layer that runs on some ranks only
    gives the ranks different rows, which the callbacks align (:meth:`align_rows`) before the
    states are reduced. Values a hook keeps on the host
    (Python counters) are moved into the states by :meth:`flush`, which the base calls before
    every reduce and checkpoint.

    Args:
        selection: which modules to hook (``None``: none; rows are made by the caller).

    Example:
        >>> class Peak(LayerStat[dict[str, float]]):
        ...     def __init__(self) -> None:
        ...         super().__init__(Selection.of("Peak", types=nn.Linear))
        ...         self.add_layer_state("peak", reduce="max")
        ...     def observe(self, name, module, output):
        ...         row = self.row(name)
        ...         self.peak[row] = torch.maximum(self.peak[row], output.detach().abs().max())
        ...     def summarize(self, states):
        ...         return dict(zip(self.layers, states["peak"].tolist()))
        ...     def tags(self, result):
        ...         return {f"peak/{k}": v for k, v in result.items()}
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> with Peak().attach(model) as stat:
        ...     _ = model(torch.ones(3, 2))
        ...     sorted(stat.tags(stat.result()))
        ['peak/0', 'peak/2']
    """

    full_state_update = False
    tag_prefix = ""

    def __init__(self, selection: Selection | None = None) -> None:
        super().__init__(sync_on_compute=True, compute_with_cache=False)
        self.selection = selection
        self.specs: dict[str, StateSpec] = {}
        self.rows: dict[str, int] = {}
        self.units: list[int] = []
        self._starts: list[int] = []  # where each row's entries begin in the per-unit states
        self._aligned = 0  # rows every rank has, in the same order (see align_rows)
        self.registry: HookRegistry | None = None  # type: ignore[assignment]
        self._hooked: tuple[str, ...] = ()
        self._windows = EpochWindows(self.specs)  # the logging points' windows, on the host

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

    @property
    def rows_grew(self) -> bool:
        """Whether rows were made since the ranks last aligned them (:meth:`align_rows`)."""
        return len(self.rows) != self._aligned

    def new_rows(self) -> list[tuple[str, int]]:
        """``(name, units)`` of the rows made since the ranks last aligned them, in order."""
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

    # --- hooks -----------------------------------------------------------------------------

    def attach(self, model: nn.Module, registry: HookRegistry | None = None) -> LayerStat[R]:
        """Forget every row and hook the selected modules of ``model`` (through ``registry``).

        Returns ``self``, a context manager that removes the hooks on exit.
        """
        check_module(type(self).__name__, "model", model)
        self.remove()
        self.rows, self.units, self._starts = {}, [], []
        self._aligned = 0
        self._windows.forget()
        device = _model_device(model)
        for spec in self.specs.values():
            setattr(self, spec.name, self._fresh(spec, 0, device))
        self.to(device)
        self.registry = HookRegistry(model) if registry is None else registry
        chosen = {name for name, _ in self.select(model)}
        # Through the registry: it warns once about selected modules that run no Python hooks.
        selected = self.registry.modules(where=lambda name, _: name in chosen)
        self._hooked = tuple(name for name, _ in selected)
        for name, module in selected:
            self.hook_module(self.registry, name, module)
        return self

    def config_key(self) -> str:
        """What tells two instances' checkpoint states apart (default: the class and selection)."""
        return f"{type(self).__name__}:{self.selection!r}"

    def select(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The modules to hook: :attr:`selection`'s (override to add others)."""
        return [] if self.selection is None else self.selection.modules(model)

    def hook_module(self, registry: HookRegistry, name: str, module: nn.Module) -> None:
        """Register the hooks of one selected module: a gated forward hook by default."""
        registry.forward_hook(module, self._forward_hook(name), gated=True)

    def _forward_hook(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if is_training_forward(module):
                with torch.no_grad():
                    self.observe(name, module, output)

        return hook

    def observe(self, name: str, module: nn.Module, output: Any) -> None:
        """Measure one training output of module ``name`` into the states (no host sync)."""
        raise NotImplementedError

    def remove(self) -> None:
        """Remove every hook this statistic registered and drop the registry (idempotent).

        Nothing of the model stays referenced: the statistic can be attached to the next one.
        """
        if self.registry is not None:
            self.registry.remove()
            self.registry = None

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # --- reduce, result, reset ---------------------------------------------------------------

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Unused by hooked statistics: their hooks write into the states (see :meth:`observe`)."""
        raise NotImplementedError(f"{type(self).__name__} is fed by its hooks, not update()")

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

    # --- logging points: a window of steps, folded into the epoch on the host ---------------

    def post_window(self, step: int) -> None:
        """End the window at a logging point: reduce its states across ranks (one collective),
        start ONE copy to the host (pinned and non-blocking on CUDA, see
        :class:`~.readback.HostMailbox`) and start a new window on the device.

        :meth:`read_window` returns it, once the copy is done, and folds it into the epoch.
        """
        self._windows.collect(wait=True)  # at most one window in flight
        packed, shapes = self._reduced()
        self._windows.post(packed, shapes, step)
        self._reset_window()

    def read_window(self, wait: bool) -> tuple[int, R] | None:
        """``(step, result)`` of the window posted at ``step``, folded into the epoch; ``None``
        when none is posted, or (``wait=False``) while its copy is still running."""
        self._windows.collect(wait)
        ready = self._windows.pop()
        if ready is None:
            return None
        step, states = ready
        return step, self.summarize(states)

    def epoch_states(self) -> dict[str, np.ndarray] | None:
        """The folded windows of the epoch (reduced, on the host), ``None`` before the first."""
        return self._windows.epoch

    def _host_states(self) -> dict[str, np.ndarray]:
        """The epoch so far: the folded windows and the current one (reduced, one copy)."""
        self._windows.collect(wait=True)
        packed, shapes = self._reduced()
        return self._windows.with_epoch(unpack(packed.cpu().numpy(), shapes))

    def result(self) -> R:
        """The statistic over the epoch so far, reduced across ranks (every rank must call it)."""
        return self.summarize(self._host_states())

    def summarize(self, states: dict[str, np.ndarray]) -> R:
        """Turn the reduced host states (float64 arrays) into the result."""
        raise NotImplementedError

    def tags(self, result: R) -> dict[str, float]:
        """The scalars ``result`` gives, by tag."""
        raise NotImplementedError

    def step_values(self, result: R) -> dict[str, float]:
        """The scalars of one logging step's window, by their epoch tag (the callback adds
        ``_step``): :meth:`tags` by default; override to leave out epoch-only ones."""
        return self.tags(result)

    def reset(self) -> None:
        """Start a new epoch: every state but ``"same"`` ones back to its identity, the folded
        windows and a window still in flight dropped; rows kept."""
        self.flush()
        self._reset_window()
        self._windows.clear()

    def _reset_window(self) -> None:
        """Start a new window on the device: every state but ``"same"`` ones to its identity."""
        for spec in self.specs.values():
            if spec.reduce != "same":
                getattr(self, spec.name).fill_(spec.identity)
        self._update_count = 0
        self._cache = None
        self._is_synced = False

    # --- checkpoint ------------------------------------------------------------------------

    def host_state(self) -> dict[str, Any]:
        """Rows, units and every state reduced across ranks, on the host (a collective)."""
        states = self._host_states()
        saved: dict[str, Any] = {"layers": list(self.rows), "units": list(self.units)}
        for name, spec in self.specs.items():
            saved[name] = torch.from_numpy(states[name]).to(spec.dtype)
        return saved

    def load_host_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`host_state` as the epoch's folded windows (reduced already, on every
        rank); the device window starts empty.

        Raises:
            ValueError: the state names layers this statistic does not watch.
            KeyError: the state lacks one of this statistic's states.
        """
        layers = tuple(state["layers"])
        self.check_layers(layers)
        units = state.get("units") or [0] * len(layers)
        for name, n in zip(layers, units, strict=True):
            self.row(name, int(n))
        self._aligned = len(self.rows)  # the same saved rows on every rank
        if self.layers != layers:
            raise ValueError(f"saved for layers {layers!r}; this one has {self.layers!r}")
        epoch: dict[str, np.ndarray] = {}
        for name, spec in self.specs.items():
            target: torch.Tensor = getattr(self, name)
            saved = torch.as_tensor(state[name])
            if saved.shape != target.shape:
                raise ValueError(f"{name}: saved shape {tuple(saved.shape)}, now {target.shape}")
            if spec.reduce == "same":
                target.copy_(saved)
            epoch[name] = saved.double().numpy().copy()
        self._reset_window()
        self._windows.epoch = epoch

    def check_layers(self, layers: tuple[str, ...]) -> None:
        """Raise ``ValueError`` unless each saved row belongs to a hooked module."""
        hooked = self.hooked_names()
        foreign = [n for n in layers if not any(n == h or n.startswith(h + ".") for h in hooked)]
        if foreign:
            raise ValueError(
                f"{type(self).__name__}: saved for layers {foreign!r}, which it does not watch"
            )

    def hooked_names(self) -> tuple[str, ...]:
        """Names a saved row may start with: the hooked modules' and the rows made so far."""
        return (*self._hooked, *self.layers)


def _model_device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")
