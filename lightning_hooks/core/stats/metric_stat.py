"""A user's ``torchmetrics.Metric``, run as a per-layer statistic.

A clone per layer is fed the layer's training outputs at logging steps and computed at each
epoch end; across ranks, one all-gather per metric state for all the layers together.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.distributed import all_gather_stacked, is_distributed, rank, world_size
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.hooks.selection import ModuleTypes, Patterns, Selection
from lightning_hooks.core.ops.tensors import iter_float_tensors
from lightning_hooks.core.stats.activation_stats import feature_modules
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.tags import layer_tag

__all__ = ["FAMILY", "MetricStat"]

FAMILY = "metrics"
"""The family of a :class:`MetricStat`'s tags: ``metrics/<name>/<layer>``."""

_BEFORE_UPDATE = r".*was called before the ``update`` method.*"
"""torchmetrics' warning when ``compute`` runs on a clone this rank never updated: the layer ran
on another rank (or before a resume), whose states the sync brings in."""


def _default_name(metric: Metric) -> str:
    """Return the default tag name of ``metric``.

    ``MeanMetric`` -> ``mean``, ``OutputEntropy`` -> ``output_entropy``.
    """
    stem = type(metric).__name__.removesuffix("Metric") or type(metric).__name__
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", stem).lower()


def _check_metric(metric: object) -> Metric:
    """Return ``metric``, checked to be a ``torchmetrics.Metric`` whose states are all tensors.

    Raises:
        TypeError: not a ``Metric`` instance (a class, a ``MetricCollection``, ...).
        ValueError: a list state (``dist_reduce_fx="cat"``).
    """
    if not isinstance(metric, Metric):
        hint = " (an instance: add the parentheses)" if isinstance(metric, type) else ""
        raise TypeError(
            f"MetricStat(metric={metric!r}): must be a torchmetrics.Metric instance, such as "
            f"torchmetrics.MeanMetric(){hint}, got {type(metric).__name__}"
        )
    lists = [name for name, value in metric.metric_state.items() if not isinstance(value, Tensor)]
    if lists:
        raise ValueError(
            f"MetricStat(metric={type(metric).__name__}()): list states ({', '.join(lists)}) are "
            "not supported: a layer's outputs kept whole at every logging step; declare tensor "
            "states (add_state(name, default=torch.tensor(...), dist_reduce_fx=...))"
        )
    return metric


class _Gathered:
    """A clone's ``dist_sync_fn`` for one compute.

    It hands every rank's value of each state, gathered already with the other layers' (one
    all-gather per state), to torchmetrics' own sync, which reduces them by the state's
    ``dist_reduce_fx``.

    ``dist_sync_fn`` is torchmetrics' public way to replace its gather; it is called with each
    state tensor itself, so the values are found by the tensor's identity. Were a release to pass
    a copy, the fallback gathers as torchmetrics does: the same values on every rank, at
    torchmetrics' cost (``tests/test_metric_stat_ddp.py`` counts the collectives).

    Args:
        by_state: each state tensor of the clone (by identity) -> its value on every rank.
    """

    def __init__(self, by_state: dict[int, list[Tensor]]) -> None:
        self.by_state = by_state

    def __call__(self, tensor: Tensor, group: object = None) -> list[Tensor]:
        """Return every rank's ``tensor``; one torchmetrics did not pass us before is gathered now.

        Args:
            tensor: a state tensor of the clone.
            group: the process group, for the fallback gather.

        Returns:
            The state's value on every rank.
        """
        gathered = self.by_state.get(id(tensor))
        return gather_all_tensors(tensor, group) if gathered is None else gathered


def _states(metric: Metric) -> dict[str, Tensor]:
    """Return ``metric``'s states, every one a tensor (:func:`_check_metric` refused lists)."""
    return {name: value for name, value in metric.metric_state.items() if isinstance(value, Tensor)}


@named_arguments
class MetricStat(LayerStat[dict[str, float]]):
    """Runs your ``torchmetrics.Metric`` per layer: a clone of ``metric`` for each one.

    A clone is made for each selected layer. Each clone's ``update`` gets the layer's training
    output at each logging step, and its ``compute`` over the epoch is logged at each epoch end
    as ``metrics/<name>/<layer>``.

    The clones are made at each fit's start (reset: ``metric``'s own states are not used). Each
    gets the layer's output tensor, detached, as it is (for a tuple or dict output, its first
    floating tensor): ``update(output)``. ``compute`` must return a number or a one-element
    tensor. Only epoch values are logged: a value per logging step would need a sync of every
    state at every logging step.

    Under DDP the layers' clones are synced together: one all-gather per metric state for all
    layers (torchmetrics alone makes a barrier and one or two all-gathers per state per layer),
    then each clone's states are reduced by their own ``dist_reduce_fx``. A layer that ran on
    some ranks only is computed from the ranks that ran it.

    Args:
        metric: the metric to clone for each layer; its states must be tensors (not lists).
        name: the statistic's name in the tags (default: the class name in snake case, without
            ``Metric``: ``MeanMetric`` -> ``mean``).
        types: the module types to watch (default: the modules that own parameters, and
            activations).
        include: glob patterns on qualified module names to watch (default: every module).
        exclude: glob patterns on qualified module names to leave out.

    Raises:
        TypeError: ``metric`` is not a ``torchmetrics.Metric`` instance.
        ValueError: ``metric`` has a list state, or ``name`` is empty or holds ``/``.

    Example:
        >>> from torchmetrics import MaxMetric
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> with MetricStat(MaxMetric(), name="output_max", types=nn.Linear).attach(model) as stat:
        ...     _ = model(torch.ones(3, 2))
        ...     sorted(stat.tags(stat.result()))
        ['metrics/output_max/0', 'metrics/output_max/2']
    """

    updates: Tensor

    def __init__(
        self,
        metric: Metric,
        *,
        name: str | None = None,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
    ) -> None:
        owner = type(self).__name__
        self.template = _check_metric(metric)
        tag_name = _default_name(metric) if name is None else name
        if not isinstance(tag_name, str) or not tag_name or "/" in tag_name:
            raise ValueError(f"{owner}(name={name!r}): must be a non-empty str without '/'")
        super().__init__(Selection.of(owner, types=types, include=include, exclude=exclude))
        self.name = tag_name
        self.metrics: dict[str, Metric] = {}
        """The clone of each hooked layer, by layer name (made at :meth:`attach`)."""
        self.add_layer_state("updates", reduce="sum")  # which layers ran, on any rank

    def config_key(self) -> str:
        """Return what tells two instances' checkpoint states apart.

        Returns:
            A key made of the class, the metric's class, the name and the selection.
        """
        return f"{super().config_key()}:{type(self.template).__name__}:{self.name}"

    def select(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Return the modules to watch.

        Without ``types``: the modules that own parameters, and activations.

        Args:
            model: the model the modules are selected from.

        Returns:
            ``(name, module)`` of each module to watch.
        """
        return feature_modules(self.selection, model)

    def _attached(self, model: nn.Module, registry: HookRegistry) -> None:
        """Make a fresh clone of the metric for every hooked layer, on the model's device."""
        self.metrics = {}
        for layer in self._hooked:
            clone = self.template.clone()
            clone.reset()
            self.metrics[layer] = clone.to(self.device)

    def observe(self, name: str, module: nn.Module, output: object) -> None:
        """Update ``name``'s clone with the output (its first floating tensor).

        Args:
            name: the module's qualified name, whose clone is updated.
            module: the module that ran.
            output: what the module returned.

        Raises:
            ValueError: ``update`` changed the shape of a state.
        """
        tensor = next((t for _, t in iter_float_tensors(output)), None)
        if tensor is None:
            return
        clone = self.metrics[name]
        clone.update(tensor.detach())
        self._check_shapes(clone)
        self.tally("updates", self.row(name))

    def _check_shapes(self, clone: Metric) -> None:
        """Refuse a state whose shape ``update`` changed.

        The layers' states are stacked and gathered by shape. Raised in the hook, so the ranks
        agree on it before any gather.

        Raises:
            ValueError: a state's shape is not its default's.
        """
        states = _states(clone)
        for name, default in _states(self.template).items():
            shape = states[name].shape
            if shape != default.shape:
                raise ValueError(
                    f"{type(self).__name__}: {type(clone).__name__}.update changed the shape of "
                    f"state {name!r} from {tuple(default.shape)} to {tuple(shape)}; each state "
                    "must keep its default's shape"
                )

    def start_copy(self, step: int) -> None:
        """Do nothing at a logging step.

        The clones keep their states on the device until the epoch ends. No value is logged per
        logging step, and no collective made.

        Args:
            step: the logging step (unused).
        """

    def summarize(self, states: dict[str, np.ndarray]) -> dict[str, float]:
        """Compute each layer that ran this epoch (on any rank) by its clone's ``compute``.

        Each is synced across ranks. A collective per state: every rank calls it.

        Args:
            states: the reduced host states (the rows' update counts).

        Returns:
            Each layer's value, by layer.

        Raises:
            TypeError: ``compute`` returned something else than one number.
        """
        ran = [layer for layer, n in zip(self.layers, states["updates"], strict=True) if n > 0]
        clones = [self.metrics[layer] for layer in ran]
        gathered = self._gather(clones)
        return {
            layer: self._compute(c, g) for layer, c, g in zip(ran, clones, gathered, strict=True)
        }

    def _gather(self, clones: list[Metric]) -> list[_Gathered | None]:
        """Gather every rank's states of ``clones``, ready for each clone's sync.

        The clones are in the aligned rows' order, the same on every rank: one all-gather per state
        for all of them.
        """
        if not clones or not is_distributed():
            return [None] * len(clones)
        by_clone: list[dict[int, list[Tensor]]] = [{} for _ in clones]
        for state, ranks in self._all_ranks(clones).items():
            for i, clone in enumerate(clones):
                by_clone[i][id(getattr(clone, state))] = list(ranks[:, i].unbind(0))
        return [_Gathered(by_state) for by_state in by_clone]

    def _all_ranks(self, clones: list[Metric]) -> dict[str, Tensor]:
        """Return each state of ``clones``, stacked and gathered.

        Each is ``[world_size, len(clones), ...]``.
        """
        return {
            name: all_gather_stacked(torch.stack([_states(c)[name] for c in clones]))
            for name in _states(self.template)
        }

    def _compute(self, clone: Metric, gathered: _Gathered | None) -> float:
        """Return ``clone.compute()`` with the ranks' states ``gathered``.

        ``None``: one process.
        """
        original = clone.dist_sync_fn
        if gathered is not None:
            clone.dist_sync_fn = gathered
        try:
            with warnings.catch_warnings():
                if clone.update_count == 0:
                    warnings.filterwarnings("ignore", message=_BEFORE_UPDATE)
                value = clone.compute()
        finally:
            clone.dist_sync_fn = original
        return _as_float(self.template, value)

    def tags(self, result: dict[str, float]) -> dict[str, float]:
        """Return ``metrics/<name>/<layer>``: each layer's value.

        Args:
            result: each layer's value, from :meth:`summarize`.

        Returns:
            The scalars, by tag.
        """
        return {layer_tag(FAMILY, self.name, layer): value for layer, value in result.items()}

    def reset(self) -> None:
        """Start a new epoch: every clone reset too."""
        super().reset()
        for clone in self.metrics.values():
            clone.reset()

    def host_state(self) -> dict[str, Any]:
        """Return the rows and their updates, and every rank's states of each row's clone.

        A collective per state: ``metric_states[state]`` is ``[world_size, rows, ...]``.

        Returns:
            The checkpoint state, by name.
        """
        state = super().host_state()
        clones = [self.metrics[layer] for layer in self.layers]
        if clones:
            gathered = self._all_ranks(clones)
            state["metric_states"] = {name: t.cpu() for name, t in gathered.items()}
        else:
            state["metric_states"] = {}
        return state

    def load_host_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`host_state`: each rank takes its own states back.

        Args:
            state: what :meth:`host_state` returned, from a checkpoint.

        Raises:
            ValueError: the state was saved by another number of processes, or names layers
                this statistic does not watch.
            KeyError: the state lacks one of the metric's states.
        """
        saved: dict[str, Tensor] = state["metric_states"]
        saved_by = {len(value) for value in saved.values()}  # the ranks saved, if any row
        if saved_by and saved_by != {world_size()}:
            raise ValueError(
                f"{type(self).__name__}: saved by {sorted(saved_by)[0]} processes, resumed on "
                f"{world_size()}; the metric's epoch so far is dropped"
            )
        super().load_host_state(state)
        for i, layer in enumerate(self.layers):
            clone = self.metrics[layer]
            for name, default in _states(self.template).items():
                value = saved[name][rank(), i].to(device=self.device, dtype=default.dtype)
                setattr(clone, name, value)


def _as_float(metric: Metric, value: object) -> float:
    """Return ``compute``'s ``value`` as a float.

    Args:
        metric: the metric whose ``compute`` returned it, named in the error.
        value: what ``compute`` returned.

    Returns:
        The value as a float.

    Raises:
        TypeError: ``value`` is not one number.
    """
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
    raise TypeError(
        f"MetricStat: {type(metric).__name__}.compute() returned {shape}; one number per layer "
        "is logged (reduce it in compute)"
    )
