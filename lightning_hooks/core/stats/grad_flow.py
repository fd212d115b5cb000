"""Per-layer gradient flow of a model, accumulated with no host sync per step.

The module also names its tags (``grad_flow/{stat}/{layer}``, ``grad_flow/global/{stat}`` and
the percentiles over the layers) and says which layers are logged one by one.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from lightning_hooks.core import checks
from lightning_hooks.core.alarms import AlarmRules, TrainingAlarms
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.clipping import Clip
from lightning_hooks.core.hooks.guard import Guard
from lightning_hooks.core.hooks.registry import HookOwner, HookRegistry
from lightning_hooks.core.hooks.selection import ModuleTypes, Patterns
from lightning_hooks.core.ops.grad_stats import (
    GRAD_STATS,
    LINEAR_IN_GRADIENT,
    NORM,
    OF_GRADIENT,
    WEIGHT,
    ParamLayout,
    grad_stats,
)
from lightning_hooks.core.ops.tensors import Workspace
from lightning_hooks.core.sharding import ShardPlan, to_local
from lightning_hooks.core.stats.accumulator import LayerStatsAccumulator, LayerTable, Reduction
from lightning_hooks.core.stats.alarm_feed import Measured
from lightning_hooks.core.stats.deprecated_alarms import deprecated_tracker_alarms
from lightning_hooks.core.stats.optimizer_view import (
    ColumnValues,
    OptimizerView,
    OptimizerViews,
    UpdateRatio,
    UpdateReader,
    ViewNorms,
)
from lightning_hooks.core.stats.output_grad import OutputGradients
from lightning_hooks.tags import GLOBAL, grad_flow_tag, percentile_stat

__all__ = [
    "GRAD_FLOW_STATS",
    "GradFlowTracker",
    "counts_the_model_itself",
    "grad_flow_scalars",
    "layers_of",
    "logged_rows",
]

GRAD_FLOW_STATS = (*GRAD_STATS, "update_ratio", "output_grad_norm", "grad_norm_preclip")
"""The tracker's columns (``grad_norm_preclip``: only with ``post_clip``)."""

_UPDATE = GRAD_FLOW_STATS.index("update_ratio")
_OUTPUT = GRAD_FLOW_STATS.index("output_grad_norm")
_PRECLIP = GRAD_FLOW_STATS.index("grad_norm_preclip")
_ALL = slice(0, len(GRAD_STATS))


def layers_of(
    model: nn.Module,
    modules: Sequence[tuple[str, nn.Module]],
    *,
    types: ModuleTypes,
    include: Patterns,
) -> ParamLayout:
    """Lay out the own parameters of the selected ``(name, module)`` pairs.

    The model's own parameters count too, as :func:`counts_the_model_itself` says.
    """
    root = model if counts_the_model_itself(types, include) else None
    return ParamLayout.from_modules(modules, root=root)


def counts_the_model_itself(types: ModuleTypes, include: Patterns) -> bool:
    """Return whether the model's own parameters (a learnable temperature, say) form a layer.

    Returns:
        ``True`` unless ``types`` or ``include`` narrows the selection.
    """
    return types is None and not include


def _check_args(model: object, optimizers: object, **flags: object) -> list[torch.optim.Optimizer]:
    """Check the tracker's arguments, naming the culprit, and return the optimizers as a list.

    Raises:
        TypeError: an argument is not of its type.
    """
    checks.module("GradFlowTracker", "model", model)
    expected = "an iterable of torch.optim.Optimizer (e.g. [optimizer])"
    if isinstance(optimizers, torch.optim.Optimizer) or not isinstance(optimizers, Iterable):
        shown = f"{type(optimizers).__name__}(...)"  # an optimizer's repr spans many lines
        raise TypeError(f"GradFlowTracker(optimizers={shown}): must be {expected}, got {shown}")
    checked = list(optimizers)
    bad = [item for item in checked if not isinstance(item, torch.optim.Optimizer)]
    if bad:
        got = f"got an item {bad[0]!r}"
        raise TypeError(f"GradFlowTracker(optimizers=[...]): must be {expected}, {got}")
    for name, flag in flags.items():
        checks.boolean("GradFlowTracker", name, flag)
    return checked


_SAMPLED_MOVED = (
    "GradFlowTracker.sampled is deprecated: read tracker.registry.logging_step, and set it with "
    "tracker.registry.set_logging_step(...)"
)


@named_arguments
class GradFlowTracker(LayerStatsAccumulator, HookOwner):
    """Tracks per-layer gradient flow (:data:`GRAD_FLOW_STATS`) over optimizer steps, no host sync.

    Call :meth:`observe` just before ``optimizer.step()`` and any clipping, on every rank. The
    update ratio (and, with ``post_clip``, the gradient the optimizer applied) is read in a hook
    after the optimizer step. While ``registry.logging_step`` is ``False`` nothing is measured.
    The alarms read the tracker through an :class:`~.alarm_feed.AlarmFeed`.

    It is a :class:`~.accumulator.LayerStatsAccumulator` of one row per layer, then the global
    row, and one column per statistic, filled by the gradient read, the output gradients' hooks
    and the update ratio. So its logging steps' copies, its result and its checkpoint state are
    those of every statistic, and a callback logs and saves it like any other. It hooks
    ``model`` when it is made.

    Args:
        model: the model to track.
        optimizers: optimizers whose steps give the update ratio (none: no update ratio).
        types: only modules of these types count as layers.
        include: glob patterns on module names to keep.
        exclude: glob patterns on module names to drop.
        update_ratio: measure the update ratio (keeps one copy of the parameters).
        output_grad: measure the gradient with respect to each layer's output.
        post_clip: gradients are clipped before the step: measure them in the step post-hook.
        clip: deprecated with ``alarms``: give it to the :class:`~.alarm_feed.AlarmFeed`.
        alarms: deprecated: make an :class:`~.alarm_feed.AlarmFeed` of the tracker. Given, the
            tracker feeds the alarms at each :meth:`observe`, and ``tracker.alarms`` is their
            ``TrainingAlarms`` (:mod:`~.deprecated_alarms`).
        max_layers_logged: :meth:`tags` for at most this many layers, non-finite first, then
            half the largest and half the smallest gradient norms, and percentiles over all
            (``None``: every layer).
        guard: catches the exceptions of the tracker's hooks (``None``: they propagate).

    Raises:
        TypeError: ``model``, ``optimizers``, ``alarms`` or a flag is not of its type.
        ValueError: no selected module owns a parameter.

    Warns:
        DeprecationWarning: ``alarms`` or ``clip`` is given.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with GradFlowTracker(model, [opt]) as tracker:
        ...     for _ in range(3):
        ...         opt.zero_grad()
        ...         model(torch.randn(16, 4)).pow(2).mean().backward()
        ...         measured = tracker.observe(opt)  # the norms an AlarmFeed reads
        ...         opt.step()
        ...     stats = tracker.result()
        >>> stats.layers, stats.count[0].tolist()
        (('0', '2', 'global'), [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 0.0])
    """

    def __init__(  # noqa: PLR0913 (a public constructor: one keyword per option)
        self,
        model: nn.Module,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        update_ratio: bool = True,
        output_grad: bool = True,
        post_clip: bool = False,
        alarms: AlarmRules | None = None,
        clip: Clip | tuple[float, str] | None = None,
        max_layers_logged: int | None = None,
        guard: Guard | None = None,
    ) -> None:
        flags = {"update_ratio": update_ratio, "output_grad": output_grad, "post_clip": post_clip}
        optimizers = _check_args(model, optimizers, **flags)
        self.registry: HookRegistry = HookRegistry(model, guard=guard)
        modules = self.registry.modules(types=types, include=include, exclude=exclude)
        self.layout = layers_of(model, modules, types=types, include=include)
        if not self.layout.layers:
            chosen = f"types={types!r}, include={include!r}, exclude={exclude!r}"
            raise ValueError(f"GradFlowTracker: no selected module owns a parameter ({chosen})")
        device = self.layout.index.device
        rows = (*self.layout.layers, GLOBAL)
        super().__init__(rows, GRAD_FLOW_STATS)
        self.to(device)
        self.max_layers_logged = max_layers_logged
        # FSDP2: parameters are DTensors; statistics of their shards are made whole per step.
        self.shards = ShardPlan.from_params(self.layout.params)
        self._workspace = Workspace()  # the |g| pass's buffer, reused every step
        self.view_norms = ViewNorms(self.shards, self._workspace)
        """Reads the gradient and weight norms of an optimizer's view."""
        self._optimizers = optimizers
        self.views = OptimizerViews(self.layout)
        """What each optimizer steps of the layout, built at its first step."""
        self._update_readers: list[UpdateReader] = []
        self._outputs = OutputGradients(self._optimizers, self.views)
        self._updates = UpdateRatio(self.shards, self._update_readers)
        self._update_ratio = update_ratio
        self._output_grad = output_grad
        self._post_clip = post_clip
        self._deprecated_alarms = deprecated_tracker_alarms(self, alarms, clip)
        self.alarms: TrainingAlarms | None = None
        """Deprecated with ``alarms``: the alarms the tracker feeds."""
        if self._deprecated_alarms is not None:
            self.alarms = self._deprecated_alarms.training_alarms
        try:
            if output_grad:
                self._outputs.hook(self.registry, modules, model)
            for optimizer in optimizers:
                self.registry.optimizer_step_post_hook(optimizer, self._after_step)
        except BaseException:
            self.registry.remove()  # a tracker half hooked leaves no hook behind
            raise

    @property
    def sampled(self) -> bool:
        """Deprecated: release 0.2.0's logging-step switch; setting it sets the registry's."""
        warnings.warn(_SAMPLED_MOVED, DeprecationWarning, stacklevel=2)
        return self.registry.logging_step

    @sampled.setter
    def sampled(self, logging_step: bool) -> None:
        warnings.warn(_SAMPLED_MOVED, DeprecationWarning, stacklevel=2)
        self.registry.set_logging_step(bool(logging_step))

    def remove(self) -> None:
        """Remove every hook of the tracker; calling it again does nothing."""
        self.registry.remove()

    def unstepped(self) -> tuple[str, ...]:
        """Return the layers with a trainable parameter in no optimizer, which are not measured."""
        return self.views.unstepped(self._optimizers)

    def add_update_reader(self, read: UpdateReader) -> None:
        """Call ``read`` with each logging step's update, before the update ratio is read.

        ``read(optimizer, view, before, after)`` gets the optimizer, its view, and the weights
        of the view before and after the step. The tracker overwrites ``before`` once the
        readers return: a reader keeps none of it.

        Args:
            read: the reader, called in the order added.
        """
        self._update_readers.append(read)

    @torch.no_grad()
    def observe(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        grad_scale: torch.Tensor | None = None,
        param_grad_scale: torch.Tensor | None = None,
        step: int | None = None,
    ) -> Measured | None:
        """Record the gradients ``optimizer`` (only its parameters) is about to apply.

        On a logging step the tracker measures them; on any other step it does nothing.

        Args:
            optimizer: the optimizer about to step.
            grad_scale: the AMP loss scale the output gradients carry, or ``None``.
            param_grad_scale: the loss scale the parameter gradients still carry, or ``None``.
            step: deprecated with ``alarms``: the optimizer step those alarms name. Without
                them it has no effect, with a ``DeprecationWarning``.

        Returns:
            What an :class:`~.alarm_feed.AlarmFeed` reads of a logging step: a copy of the
            gradient norms per layer, the rows stepped and the backward order; ``None`` on any
            other step, or where ``optimizer`` steps no tracked layer.
        """
        measured = None
        if self.registry.logging_step:
            measured = self._measure(optimizer, grad_scale, param_grad_scale)
        self._outputs.order.clear()
        if self._deprecated_alarms is None and step is not None:
            warnings.warn(
                "GradFlowTracker.observe(step=...) is deprecated, and without the tracker's "
                "alarms= it has no effect: give the step to the alarms' feed, "
                "feed.observe(optimizer, measured, step=step)",
                DeprecationWarning,
                stacklevel=3,  # this method, the no_grad wrapper, then the user's line
            )
        if self._deprecated_alarms is not None:
            self._deprecated_alarms.observe(
                optimizer,
                measured,
                step=step,
                grad_scale=grad_scale,
                param_grad_scale=param_grad_scale,
            )
        return measured

    def _measure(
        self,
        optimizer: torch.optim.Optimizer,
        grad_scale: torch.Tensor | None,
        param_grad_scale: torch.Tensor | None,
    ) -> Measured | None:
        """Measure a logging step's statistics of ``optimizer``'s layers into the accumulator.

        Returns:
            A copy of the gradient norms and the backward order, for the alarms; ``None`` where
            ``optimizer`` steps no tracked layer.
        """
        view = self.views.view(optimizer)
        if not view.params:
            return None
        valid = view.valid()
        grads = ParamLayout.grads(view.params)
        if self._post_clip:  # the gradient applied is read after the step; now the weight norm
            stats = self.view_norms.norms(view, grads, weights=True)
        else:
            stats = self._grad_stats(view, grads, weights=True)
        if param_grad_scale is not None:
            stats[:, LINEAR_IN_GRADIENT] /= param_grad_scale
        # the alarms' own copy: recording the step may add into ``stats`` in place
        stepped = None if valid is None else valid[:, NORM]
        measured = Measured(stats[:, NORM].clone(), stepped, tuple(self._outputs.order))
        self._record_step(optimizer, view, stats, valid, grad_scale)
        return measured

    def _grad_stats(
        self, view: OptimizerView, grads: list[torch.Tensor], *, weights: bool
    ) -> torch.Tensor:
        """Return ``[rows, GRAD_STATS]`` of the layers ``view`` steps, FSDP2 shards made whole."""
        params = [to_local(p) for p in view.params] if weights else None
        return grad_stats(
            grads, params, view.layer_index, shards=self.shards, workspace=self._workspace
        )

    def _record_step(
        self,
        optimizer: torch.optim.Optimizer,
        view: OptimizerView,
        stats: torch.Tensor,
        valid: torch.Tensor | None,
        grad_scale: torch.Tensor | None,
    ) -> None:
        """Add one step's statistics of ``view`` into the accumulator.

        The weights are kept for the update ratio.
        """
        if self._post_clip:
            # Under clipping, the gradient read before the step is the one before clipping: its
            # norm goes to grad_norm_preclip. The gradient applied is read in the step post-hook.
            read = [NORM, WEIGHT]
            cells = None if valid is None else valid[:, read]
            self.update(
                stats[:, read],
                columns=[_PRECLIP, WEIGHT],
                rows=view.cells,
                valid=cells,
                replicated=True,
            )
        else:
            self.update(stats, columns=_ALL, rows=view.cells, valid=valid, replicated=True)
        if self._update_ratio:
            self._updates.keep(view, stats[:, WEIGHT])
        if self._output_grad:
            self._update_column(_OUTPUT, self._outputs.record(optimizer, view, grad_scale))

    def _update_column(self, column: int, got: ColumnValues | None) -> None:
        """Add a reader's values of one statistic, if it returned any."""
        if got is not None:
            self.update(
                got.values, columns=[column], rows=got.rows, valid=got.valid, replicated=True
            )

    @torch.no_grad()
    def _after_step(self, optimizer: torch.optim.Optimizer, *args: object) -> None:
        """Read the applied gradient (``post_clip``) and the update ratio after the step."""
        view = self.views.built.get(id(optimizer))
        if view is None or not view.params or not self.registry.logging_step:
            return
        if self._post_clip:
            # After clipping and the update, p.grad still holds what the optimizer applied.
            valid = view.valid()
            stats = self._grad_stats(view, ParamLayout.grads(view.params), weights=False)
            cells = None if valid is None else valid[:, OF_GRADIENT]
            self.update(
                stats[:, OF_GRADIENT],
                columns=OF_GRADIENT,
                rows=view.cells,
                valid=cells,
                replicated=True,
            )
        self._update_column(_UPDATE, self._updates.record(optimizer, view))

    def drain(self) -> None:
        """Add the output gradients of the steps since the last reduce, then the host's counts.

        The output gradients are summed across ranks here, so every reduce (:meth:`start_copy`,
        :meth:`result`, :meth:`host_state`) reads them.
        """
        self._update_column(_OUTPUT, self._outputs.reduce_kept_steps())
        super().drain()

    def reset(self) -> None:
        """Start a new accumulation period (an epoch); parameters are looked up afresh."""
        self._outputs.reset()  # the output gradients not yet reduced belong to the old period
        super().reset()
        self.views.clear()

    def tags(self, result: LayerTable) -> dict[str, float]:
        """Return ``grad_flow/{stat}/{layer}`` and ``grad_flow/global/{stat}`` by tag.

        They are the means, and the peaks as ``*_max`` (at most ``max_layers_logged`` layers, and
        percentiles over them all).
        """
        return dict(grad_flow_scalars(result, self.max_layers_logged, step=False))

    def step_values(self, result: LayerTable) -> dict[str, float]:
        """Return one logging step's :meth:`tags`, but the peaks (a step's mean is its value)."""
        return dict(grad_flow_scalars(result, self.max_layers_logged, step=True))


class _Column(NamedTuple):
    """A tag logged per layer: its suffix, the table's statistic and its reduction over steps."""

    suffix: str
    stat: str
    kind: Reduction
    """``"mean"``, ``"peak"`` or ``"total"`` (a :meth:`LayerTable.column` kind)."""
    per_step: bool = True
    """Whether each logging step logs it too. A peak is logged per epoch only: at one logging
    step the peak of a statistic equals the statistic, which is already logged."""


_LOGGED = (
    _Column(suffix="grad_norm", stat="grad_norm", kind="mean"),
    _Column(suffix="grad_norm_max", stat="grad_norm", kind="peak", per_step=False),
    _Column(suffix="grad_abs_mean", stat="grad_abs_mean", kind="mean"),
    _Column(suffix="grad_abs_max", stat="grad_abs_max", kind="peak"),
    _Column(suffix="grad_nonfinite", stat="grad_nonfinite", kind="total"),
    _Column(suffix="weight_norm", stat="weight_norm", kind="mean"),
    _Column(suffix="update_ratio", stat="update_ratio", kind="mean"),
    _Column(suffix="update_ratio_max", stat="update_ratio", kind="peak", per_step=False),
    _Column(suffix="output_grad_norm", stat="output_grad_norm", kind="mean"),
    _Column(suffix="output_grad_norm_max", stat="output_grad_norm", kind="peak", per_step=False),
    _Column(suffix="grad_norm_preclip", stat="grad_norm_preclip", kind="mean"),
)
_PERCENTILES = (5, 50, 95)


def grad_flow_scalars(
    stats: LayerTable, max_layers: int | None, *, step: bool
) -> Iterator[tuple[str, float]]:
    """Yield ``(tag, value)`` of a gradient-flow table, for an epoch or a logging step.

    They are the means per layer and over the model, the peaks and totals, and beyond
    ``max_layers`` layers percentiles over them all.

    Args:
        stats: the gradient-flow table, the global row last.
        max_layers: the most layers logged one by one (``None``: all).
        step: a logging step's scalars, without the peaks (``*_max``); else an epoch's.
    """
    last = len(stats.layers) - 1  # the global row
    rows = logged_rows(stats, max_layers)
    if stats.count[-1, stats.stats.index("grad_norm_preclip")] > 0:  # clipped: the applied one
        yield grad_flow_tag("grad_norm_postclip"), float(stats.column("grad_norm")[-1])
    for suffix, stat, kind, per_step in _LOGGED:
        if step and not per_step:
            continue
        column = stats.column(stat, kind)
        counts = stats.count[:, stats.stats.index(stat)]
        for row in (*rows, last):
            if counts[row] == 0:
                continue
            layer = stats.layers[row]
            tag = grad_flow_tag(suffix, None if row == last else layer)
            yield tag, float(column[row])
        values = column[:last][(counts[:last] > 0) & np.isfinite(column[:last])]
        if len(rows) < last and values.size:  # percentiles over the layers
            for q, value in zip(_PERCENTILES, np.percentile(values, _PERCENTILES), strict=True):
                yield grad_flow_tag(percentile_stat(suffix, q)), float(value)


def logged_rows(stats: LayerTable, max_layers: int | None) -> list[int]:
    """Return the layer rows of ``stats`` to log, at most ``max_layers`` (``None``: all).

    Past that many, the non-finite rows come first, then half the places go to the largest
    gradient norms (with an odd place) and half to the smallest. A layer that got no gradient
    has no value to log, and takes no place.
    """
    num_layers = len(stats.layers) - 1
    if max_layers is None or num_layers <= max_layers:
        return list(range(num_layers))
    norm = stats.column("grad_norm")[:num_layers]
    measured = stats.count[:num_layers, stats.stats.index("grad_norm")] > 0
    nonfinite = stats.column("grad_nonfinite", "total")[:num_layers]
    bad_rows = measured & ((nonfinite > 0) | ~np.isfinite(norm))
    bad = [int(i) for i in np.flatnonzero(bad_rows)][:max_layers]
    by_norm = np.argsort(np.where(np.isfinite(norm), norm, np.inf))
    order = [int(i) for i in by_norm if measured[i] and i not in bad]
    top = (max_layers - len(bad) + 1) // 2  # an odd place goes to the largest
    smallest = order[: max_layers - len(bad) - top]
    largest = order[len(order) - top :] if top else []
    return sorted({*bad, *smallest, *largest})
