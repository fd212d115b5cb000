"""``LayerStat``, the base of every per-layer statistic, and the states it holds.

Its states are on the model's device, reduced across ranks in one packed collective
(:class:`RowStates`), and each logging step's values are copied to the host.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import numpy as np
import torch
from torch import nn
from typing_extensions import Self

from lightning_hooks.core.checks import module as check_module
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.distributed import all_gather_stacked, is_distributed
from lightning_hooks.core.hooks.registry import HookOwner, HookRegistry
from lightning_hooks.core.hooks.selection import Selection
from lightning_hooks.core.hooks.shared import Snapshots
from lightning_hooks.core.host_copy import HostCopy
from lightning_hooks.core.ops.tensors import Pending, is_training_forward

__all__ = ["Kind", "LayerStat", "Reduce", "RowStates", "StateSpec", "unpack"]

R = TypeVar("R")

Reduce = Literal["sum", "max", "min", "same"]
"""How a state's entries combine over steps and ranks: summed, the largest, the smallest, or
``"same"`` for values every rank holds alike (histogram bin edges)."""
Kind = Literal["layer", "unit", "global"]
"""Where a state's entries live: a row per layer, a run per row's units, or one for the model."""


@dataclass(frozen=True)
class StateSpec:
    """One declared state (see :data:`Kind`)."""

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
    return _packing_dtype(device) if spec.dtype == torch.float64 else spec.dtype


def _packing_dtype(device: torch.device) -> torch.dtype:
    """Return the dtype states are reduced and copied in: float64, or float32 on MPS."""
    return torch.float32 if device.type == "mps" else torch.float64


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


_COMBINE = {"sum": np.add, "max": np.maximum, "min": np.minimum}
"""How an epoch folds its logging steps' states together, by reduce."""


class RowStates(ABC, Generic[R]):
    """Per-layer states and their logging steps, turned into a result ``R``.

    The states are declared (:meth:`add_layer_state`), grown a row at a time, aligned and
    reduced across ranks in one collective. Each logging step's states are copied to the host
    without waiting (:meth:`start_copy`, then :meth:`take_copy`) and folded into the epoch, which
    checkpoints save (:meth:`host_state`). A subclass implements :meth:`summarize` and
    :meth:`tags`, and feeds the states itself, as
    :class:`~lightning_hooks.core.stats.accumulator.LayerStatsAccumulator` does, or through
    module hooks, as :class:`LayerStat` does.
    """

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.specs: dict[str, StateSpec] = {}
        self.rows: dict[str, int] = {}
        self.units: list[int] = []
        self._starts: list[int] = []  # where each row's entries begin in the per-unit states
        self._aligned = 0  # rows every rank has, in the same order (see align_rows)
        self._counts: dict[str, dict[int, int]] = {}  # host-side counts by state (see tally)
        self._hooked: tuple[str, ...] = ()  # modules hooked: a saved row's name may start with one
        self._epoch: dict[str, np.ndarray] | None = None
        self._host_copy: HostCopy | None = None
        self._ready: list[tuple[int, dict[str, np.ndarray]]] = []  # folded, not yet read

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
                    f"now {units}; pass the unit dimension whose size does not change "
                    "(unit_dim=)"
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

    def _start_afresh(self, device: torch.device) -> None:
        """Forget every row, state and logging step, the states emptied on ``device``.

        A statistic attached to a new model starts so (:meth:`LayerStat.attach`): unlike
        :meth:`reset`, which keeps the rows of the same model, and the host copy on its device.
        """
        self._epoch = None
        self._host_copy = None
        self._ready = []
        self._drop_rows(device)
        self.to(device)

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
        """Return whether rows were made since :meth:`align_rows`.

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

        Thus a module run on some ranks only does not hang the collective. For example, with
        rows ``[x]`` aligned before, rank 0 made ``[a, b]`` since and rank 1 made ``[b, c]``:
        both end with ``[x, a, b, c]``. A row this rank made keeps its entries; a row only
        another rank made starts at each state's identity.

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
            # Cut the states back to the aligned rows, then add the new rows in rank order,
            # copying back the entries of the rows this rank made.
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
        dtype = _packing_dtype(self.device)
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

    def _reset_step_states(self) -> None:
        """Start the next logging step: every state but ``"same"`` ones back to its identity."""
        for spec in self.specs.values():
            if spec.reduce != "same":
                getattr(self, spec.name).fill_(spec.identity)

    def start_copy(self, step: int) -> None:
        """End a logging step: reduce its values across ranks and start their host copy.

        Args:
            step: the logging step, returned with the copy by :meth:`take_copy`.
        """
        self._collect(wait=True)  # at most one logging step's copy in flight
        packed, shapes = self._reduced()
        host_copy = self._host_copy
        if host_copy is None or host_copy.shape != tuple(packed.shape):
            host_copy = HostCopy(tuple(packed.shape), packed.device, packed.dtype)
            self._host_copy = host_copy
        host_copy.post(packed, meta=(step, shapes))
        self._reset_step_states()

    def _collect(self, wait: bool) -> None:
        """Fold the started copy into the epoch once done (``wait``: block)."""
        got = None if self._host_copy is None else self._host_copy.read(wait)
        if got is not None:
            view, (step, shapes) = got
            states = unpack(view, shapes)
            # a copy: the step's values are kept too, until read
            self._epoch = {k: v.copy() for k, v in self._with_epoch(states).items()}
            self._ready.append((step, states))

    def take_copy(self, wait: bool) -> tuple[int, R] | None:
        """Return the started copy's step and result.

        Args:
            wait: block until the copy is done.

        Returns:
            ``(step, result)`` of the started copy; ``None`` when none is, or while copying.
        """
        self._collect(wait)
        if not self._ready:
            return None
        step, states = self._ready.pop(0)
        return step, self.summarize(states)

    @property
    def copy_in_flight(self) -> bool:
        """Return whether a started copy was not yet returned by :meth:`take_copy`.

        Returns:
            Whether a copy is in flight.
        """
        return bool(self._ready) or (self._host_copy is not None and self._host_copy.pending)

    def _with_epoch(self, step_states: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Combine the epoch's states so far with one more logging step's, ``step_states``.

        Each state combines by its reduce: ``"sum"`` states add, ``"max"`` and ``"min"`` states
        take the larger or smaller, and ``"same"`` states take the newest. Rows made since the
        epoch's last logging step start from their identity.
        """
        if self._epoch is None:
            return step_states
        pooled = {}
        for name, new in step_states.items():
            spec = self.specs[name]
            old = self._epoch[name]
            if old.shape != new.shape:  # rows made since
                fresh = np.full((len(new) - len(old), *old.shape[1:]), spec.identity)
                old = np.concatenate([old, fresh])
            pooled[name] = new if spec.reduce == "same" else _COMBINE[spec.reduce](old, new)
        return pooled

    def _host_states(self) -> dict[str, np.ndarray]:
        """Return the epoch so far: its logging steps folded, and the running one."""
        self._collect(wait=True)
        packed, shapes = self._reduced()
        return self._with_epoch(unpack(packed.cpu().numpy(), shapes))

    def result(self) -> R:
        """Return the statistic over the epoch so far, reduced across ranks.

        Every rank must call it.

        Returns:
            What :meth:`summarize` makes of the reduced states.
        """
        return self.summarize(self._host_states())

    @abstractmethod
    def summarize(self, states: dict[str, np.ndarray]) -> R:
        """Turn the reduced host states (float64 arrays) into the result.

        Args:
            states: each state by name, reduced across ranks, on the host.

        Returns:
            The result.
        """

    @abstractmethod
    def tags(self, result: R) -> dict[str, float]:
        """Return the scalars ``result`` gives, by tag.

        Args:
            result: what :meth:`result` returned.

        Returns:
            The scalars, by tag.
        """

    def step_values(self, result: R) -> dict[str, float]:
        """Return the scalars of one logging step, by epoch tag (default: :meth:`tags`).

        Args:
            result: the logging step's result.

        Returns:
            The scalars, by epoch tag.
        """
        return self.tags(result)

    def reset(self) -> None:
        """Start a new epoch.

        States (but ``"same"`` ones) and logging steps are dropped, rows kept.
        """
        self.drain()
        self._reset_step_states()
        self._epoch = None
        self._ready = []  # and a logging step's copy still in flight
        if self._host_copy is not None:
            self._host_copy.clear()

    def host_state(self) -> dict[str, Any]:
        """Return rows, units and every state reduced across ranks, on the host (a collective).

        Returns:
            The checkpoint state, by name.
        """
        states = self._host_states()
        saved = {name: torch.from_numpy(states[name]).to(s.dtype) for name, s in self.specs.items()}
        return {"layers": list(self.rows), "units": list(self.units), **saved}

    def load_host_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`host_state` as the epoch's folded logging steps (the running one empty).

        Args:
            state: what :meth:`host_state` returned, from a checkpoint.

        Raises:
            ValueError: the state names layers this statistic does not watch, or a state's saved
                shape differs from its shape now.
            KeyError: the state lacks one of this statistic's states.
        """
        layers = tuple(state["layers"])
        hooked = (*self._hooked, *self.layers)  # what a saved row's name may start with
        foreign = [n for n in layers if not any(n == h or n.startswith(h + ".") for h in hooked)]
        if foreign:
            raise ValueError(
                f"{type(self).__name__}: saved for layers {foreign!r}, which it does not watch"
            )
        # The rows the state would leave, checked before any is made: a state saved for other
        # layers adds none.
        grown = (*self.layers, *(name for name in layers if name not in self.rows))
        if grown != layers:
            raise ValueError(f"saved for layers {layers!r}; this one has {self.layers!r}")
        units = state.get("units") or [0] * len(layers)
        for name, n in zip(layers, units, strict=True):
            self.row(name, int(n))
        self._aligned = len(self.rows)  # the same saved rows on every rank
        epoch: dict[str, np.ndarray] = {}
        for name, spec in self.specs.items():
            target: torch.Tensor = getattr(self, name)
            saved = torch.as_tensor(state[name])
            if saved.shape != target.shape:
                raise ValueError(f"{name}: saved shape {tuple(saved.shape)}, now {target.shape}")
            if spec.reduce == "same":
                target.copy_(saved)
            epoch[name] = saved.double().numpy().copy()
        self._reset_step_states()
        self._epoch = epoch


@named_arguments
class LayerStat(RowStates[R], HookOwner):
    """The base of each per-layer statistic: states on the model's device, one collective, one copy.

    Subclasses declare states in ``__init__`` (:meth:`add_layer_state`, ...) and implement
    :meth:`observe` (or :meth:`hook_module`), :meth:`summarize` and :meth:`tags`; the base owns
    the hooks, the reduce across ranks, reset and the checkpoint state.

    In the words of torchmetrics' ``Metric``: :meth:`observe` is ``update``, called for each
    layer's output; :meth:`summarize` is ``compute``, given the states already reduced across
    ranks (``sync``); :meth:`reset` is ``reset``. What ``Metric`` does not have: a logging step's
    states are copied to the host without waiting (:meth:`start_copy`, then :meth:`take_copy`),
    and the epoch so far is saved in checkpoints (:meth:`host_state`).

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

    def __init__(self, selection: Selection | None = None) -> None:
        super().__init__()
        self.selection = selection
        self.registry: HookRegistry | None = None
        self._pending: Pending[Any] = Pending()  # small outputs' snapshots (see _defer)
        self._snapshots: Snapshots | None = None  # shared with the registry's other statistics

    def attach(self, model: nn.Module, registry: HookRegistry | None = None) -> Self:
        """Forget every row and hook ``model``.

        A statistic is made once and attached at each fit, which starts it afresh, as
        torchmetrics' ``Metric`` is made once and ``reset``.

        Args:
            model: the model whose selected modules are hooked; its device is the states'.
            registry: the registry the hooks go on (``None``: a new one on ``model``).

        Returns:
            ``self``, a context manager.
        """
        check_module(type(self).__name__, "model", model)
        self.remove()
        params = itertools.chain(model.parameters(), model.buffers())
        self._start_afresh(next((t.device for t in params), torch.device("cpu")))
        self.registry = HookRegistry(model) if registry is None else registry
        self._snapshots = self.registry.shared.snapshots
        chosen = {name for name, _ in self.select(model)}
        # The registry warns once about selected modules that run no Python hooks.
        selected = self.registry.modules(where=lambda name, _: name in chosen)
        self._hooked = tuple(name for name, _ in selected)
        for name, module in selected:
            self.hook_module(self.registry, name, module)
        self._attached(model, self.registry)
        return self

    def _attached(self, model: nn.Module, registry: HookRegistry) -> None:
        """Set up what needs the hooked model (runs last in :meth:`attach`)."""

    def config_key(self) -> str:
        """Return what tells two instances' checkpoint states apart.

        Returns:
            A key made of the class and the selection.
        """
        return f"{type(self).__name__}:{self.selection!r}"

    def select(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Return the modules to hook: :attr:`selection`'s (override to add others).

        Args:
            model: the model the modules are selected from.

        Returns:
            ``(name, module)`` of each module to hook.
        """
        return [] if self.selection is None else self.selection.modules(model)

    def hook_module(self, registry: HookRegistry, name: str, module: nn.Module) -> None:
        """Register the hooks of one selected module: a gated forward hook by default.

        Args:
            registry: the registry the hooks go on.
            name: the module's qualified name, its row's name.
            module: the module hooked.
        """
        registry.forward_hook(module, self._forward_hook(name), gated=True)

    def _forward_hook(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        """Return the forward hook of module ``name``, which observes its training outputs."""

        def hook(module: nn.Module, args: tuple[Any, ...], output: object) -> None:
            if not is_training_forward(module):  # grad is enabled past here
                return
            with torch.no_grad():
                self.observe(name, module, output)

        return hook

    def observe(self, name: str, module: nn.Module, output: object) -> None:
        """Measure one training output of module ``name`` into the states (no host sync).

        Args:
            name: the module's qualified name, its row's name.
            module: the module that ran.
            output: what the module returned.

        Raises:
            NotImplementedError: a subclass hooks with the default forward hook but does not
                implement it.
        """
        raise NotImplementedError

    def _defer(self, key: Hashable, row: int, snapshot: torch.Tensor) -> None:
        """Store a small output's ``snapshot`` for ``row``, stacked by ``key`` at :meth:`drain`."""
        if self._pending.add(key, row, snapshot):
            self.drain()

    def _snapshot(self, tensor: torch.Tensor) -> torch.Tensor:
        """Return a copy of an output to :meth:`_defer`, before an in-place op overwrites it.

        There is one copy for every statistic on the model, whichever callback holds it
        (:class:`~.tensors.Snapshots`).
        """
        if self._snapshots is None:
            return tensor.detach().clone()
        return self._snapshots.copy(tensor)

    def _drain_pending(self) -> Iterator[tuple[Any, list[int], torch.Tensor]]:
        """Yield the held snapshots, a stack per key (:meth:`Pending.drain`).

        The shared copies are let go (each holder keeps its own).
        """
        if self._snapshots is not None:
            self._snapshots.clear()
        return self._pending.drain()

    def remove(self) -> None:
        """Remove every hook, the registry and snapshots not yet measured (idempotent)."""
        self._pending.clear()
        if self._snapshots is not None:
            self._snapshots.clear()
            self._snapshots = None
        if self.registry is not None:
            self.registry.remove()
            self.registry = None
