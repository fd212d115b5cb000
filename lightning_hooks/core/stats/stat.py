"""Provide ``LayerStat``, the base of every per-layer statistic.

Its states are on the model's device, and each logging step's values are copied to the host.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from torch import nn
from typing_extensions import Self

from lightning_hooks.core.checks import module as check_module
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.registry import HookOwner, HookRegistry
from lightning_hooks.core.hooks.selection import Selection
from lightning_hooks.core.hooks.shared import Snapshots
from lightning_hooks.core.ops.tensors import Pending, is_training_forward
from lightning_hooks.core.stats.states import Reduce, RowStates, StateSpec, unpack
from lightning_hooks.core.transport import HostCopy

__all__ = ["LayerStat", "Reduce", "StateSpec"]

R = TypeVar("R")


_COMBINE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


@named_arguments
class LayerStat(RowStates, HookOwner, ABC, Generic[R]):
    """Base of every per-layer statistic: states on the model's device, one collective, one copy.

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
        self._hooked: tuple[str, ...] = ()
        self._pending: Pending[Any] = Pending()  # small outputs' snapshots (see _defer)
        self._snapshots: Snapshots | None = None  # shared with the registry's other statistics
        self._epoch: dict[str, np.ndarray] | None = None
        self._host_copy: HostCopy | None = None
        self._ready: list[tuple[int, dict[str, np.ndarray]]] = []  # folded, not yet read

    def attach(self, model: nn.Module, registry: HookRegistry | None = None) -> Self:
        """Forget every row and hook ``model``.

        Args:
            model: the model whose selected modules are hooked; its device is the states'.
            registry: the registry the hooks go on (``None``: a new one on ``model``).

        Returns:
            ``self``, a context manager.
        """
        check_module(type(self).__name__, "model", model)
        self.remove()
        self._epoch = None
        self._host_copy = None
        self._ready = []
        params = itertools.chain(model.parameters(), model.buffers())
        device = next((t.device for t in params), torch.device("cpu"))
        self._drop_rows(device)
        self.to(device)
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
        """Hold a small output's ``snapshot`` for ``row``, stacked by ``key`` at :meth:`drain`."""
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

    def start_copy(self, step: int) -> None:
        """End a logging step: reduce its values across ranks and start their host copy.

        Args:
            step: the logging step, returned with the copy by :meth:`take_copy`.
        """
        self._collect(wait=True)  # at most one logging step's copy in flight
        packed, shapes = self._reduced()
        box = self._host_copy
        if box is None or box.shape != tuple(packed.shape):
            box = HostCopy(tuple(packed.shape), packed.device, packed.dtype)
            self._host_copy = box
        box.post(packed, meta=(step, shapes))
        self._reset_window()

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
        """Say whether a started copy was not yet returned by :meth:`take_copy`.

        Returns:
            Whether a copy is in flight.
        """
        return bool(self._ready) or (self._host_copy is not None and self._host_copy.pending)

    def _with_epoch(self, window: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Return the epoch's logging steps so far, folded, and one more.

        The one more is ``window`` (some or all of the states).
        """
        if self._epoch is None:
            return window
        pooled = {}
        for name, new in window.items():
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
        self._reset_window()
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
        self._epoch = epoch
