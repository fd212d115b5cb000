"""The part of a gradient-flow layout that each optimizer steps, its norms and update ratio."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from lightning_hooks import internals
from lightning_hooks.core import checks
from lightning_hooks.core.alarms import HostSegments
from lightning_hooks.core.ops.grad_stats import (
    GRAD_STATS,
    GRADIENT_STATS,
    NORM,
    WEIGHT,
    LayerIndex,
    ParamLayout,
    param_norms,
    segment_norm,
    update_norms,
)
from lightning_hooks.core.ops.tensors import Workspace
from lightning_hooks.core.sharding import ShardPlan, to_local

__all__ = [
    "ColumnValues",
    "OptimizerView",
    "OptimizerViews",
    "Read",
    "UpdateRatio",
    "UpdateReader",
    "ViewNorms",
    "adaptive",
]

Read = Callable[[Sequence[torch.Tensor]], torch.Tensor]
"""A read of gradients' L2 norms, one per gradient."""
UpdateReader = Callable[
    [torch.optim.Optimizer, "OptimizerView", list[torch.Tensor], list[torch.Tensor]], None
]
"""Reads a logging step's update: the optimizer, its view, and the weights before and after the
step."""
_OF_GRADIENT = tuple(name in GRADIENT_STATS for name in GRAD_STATS)
"""Per column of :data:`GRAD_STATS`: whether a layer with no gradient has no value there."""


class ColumnValues(NamedTuple):
    """A step's values of one statistic, as a reader hands them to the tracker's ``update``."""

    values: torch.Tensor
    """``[rows, 1]``, or ``[steps, rows, 1]`` for several steps."""
    rows: torch.Tensor | slice
    """The layout rows of ``values``."""
    valid: torch.Tensor
    """Which cells have a value."""


@dataclass(eq=False)
class OptimizerView:
    """The tracked parameters that one optimizer steps, and where they add up per layer.

    :class:`OptimizerViews` builds it at the optimizer's step. It describes the parameters;
    what its readers keep between steps (the update ratio's copy of the weights, the alarms'
    quiet read) they keep themselves, by view.
    """

    params: tuple[nn.Parameter, ...]
    """The tracked parameters the optimizer steps, in the layout's order."""
    index: torch.Tensor
    """Each parameter's row among :attr:`rows` (the layers it steps, numbered from 0)."""
    rows: torch.Tensor
    """The layout rows of the layers it steps, then the global row."""
    owner: tuple[int, ...]
    """:attr:`index` on the host."""
    key: tuple[int, ...]
    """The sizes of the optimizer's param_groups the view was built for."""
    unique: torch.Tensor
    """The positions of each parameter's first listing: a shared one counts once globally."""
    numel: torch.Tensor
    """``[layers + 1]``: the elements it steps per layer, then in all (a shared one once)."""
    row_ids: tuple[int, ...]
    """:attr:`rows` on the host."""
    segments: HostSegments
    """:attr:`index` and :attr:`unique` on the host, as the alarms read per-parameter norms."""
    every_row: bool = False
    """Whether it steps every layer of the layout (one optimizer's usual case)."""
    masks: dict[tuple[bool, ...], torch.Tensor] = field(default_factory=dict)
    """:meth:`valid`'s masks, by the pattern of missing gradients."""
    layer_ids: frozenset[int] = field(init=False)
    """The layout rows of the layers it steps, on the host."""
    layer_index: LayerIndex = field(init=False)
    """How each parameter adds into its layer's row and into the global row."""
    distinct: bool = field(init=False)
    """Whether no parameter is listed twice."""
    scale: float = field(init=False)
    """The square root of the number of entries it steps. Clipping by value at ``v`` keeps the
    global norm at most ``v * scale``: the bound *explosion* compares a norm with."""

    def __post_init__(self) -> None:
        """Make the host-side rows and the layer index once, from the fields."""
        self.layer_ids = frozenset(self.row_ids[:-1])
        self.layer_index = LayerIndex(self.index, self.numel[:-1], self.unique, self.numel[-1])
        self.distinct = len(self.unique) == len(self.params)
        self.scale = sum(p.numel() for p in self.params) ** 0.5

    @property
    def cells(self) -> torch.Tensor | slice:
        """:attr:`rows` as the accumulator takes them: a slice, with no gather, for every row."""
        return slice(None) if self.every_row else self.rows

    @property
    def layer_cells(self) -> torch.Tensor | slice:
        """:attr:`cells` but the global row: the layers it steps."""
        return slice(0, len(self.row_ids) - 1) if self.every_row else self.rows[:-1]

    def valid(self) -> torch.Tensor | None:
        """Return which cells have a value at this step.

        Returns:
            ``[layers + 1, GRAD_STATS]``, false in the gradient columns of layers with no
            gradient at this step (cached per pattern); ``None`` if no gradient is missing.
        """
        missing = tuple([p.grad is None for p in self.params])  # one frame, not one per tensor
        if not any(missing):
            return None
        mask = self.masks.get(missing)
        if mask is None:
            has = [False] * (len(self.rows) - 1)
            for owner, gone in zip(self.owner, missing, strict=True):
                has[owner] = has[owner] or not gone
            table = [
                [has_grad or not of_gradient for of_gradient in _OF_GRADIENT]
                for has_grad in [*has, any(has)]
            ]
            mask = torch.tensor(table, dtype=torch.bool, device=self.rows.device)
            self.masks[missing] = mask
        return mask


_SECOND_MOMENT = ("exp_avg_sq", "square_avg", "sum", "exp_avg_sq_row")
"""Optimizer state keys of a per-coordinate second moment (Adam, RMSprop, Adagrad, Adafactor)."""


def adaptive(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> bool:
    """Return whether ``optimizer`` is adaptive: it keeps a second moment for ``params[0]``."""
    state = optimizer.state.get(params[0], {}) if params else {}
    return any(key in state for key in _SECOND_MOMENT)


def _groups_key(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    """Return the sizes of ``optimizer``'s param_groups, which a view is built for."""
    return tuple(len(group["params"]) for group in optimizer.param_groups)


def _held(optimizer: torch.optim.Optimizer) -> set[int]:
    """Return the ids of the parameters in ``optimizer``'s param_groups."""
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


class OptimizerViews:
    """Builds and keeps the :class:`OptimizerView` of each optimizer over ``layout``, at its step.

    :attr:`generation` changes whenever a view is built or dropped.

    Args:
        layout: the gradient-flow layout the views select from.
    """

    def __init__(self, layout: ParamLayout) -> None:
        self.layout = layout
        self.generation = 0
        self.built: dict[int, OptimizerView] = {}  # by the optimizer's ``id``, as built

    def view(self, optimizer: torch.optim.Optimizer) -> OptimizerView:
        """Return the view of ``optimizer``, about to step.

        It is built anew when its param_groups change and after :meth:`clear` (a parameter
        unfrozen by ``requires_grad`` alone counts from there).
        """
        view = self.current(optimizer)
        if view is None:
            checks.optimizer("GradFlowTracker.observe", "optimizer", optimizer)
            view = self._build(optimizer, _groups_key(optimizer))
            self.built[id(optimizer)] = view
        return view

    def current(self, optimizer: torch.optim.Optimizer) -> OptimizerView | None:
        """Return the view built at ``optimizer``'s last step, or ``None`` if its groups changed."""
        view = self.built.get(id(optimizer))
        if view is not None and view.key != _groups_key(optimizer):
            del self.built[id(optimizer)]
            self.generation += 1
            return None
        return view

    def clear(self) -> None:
        """Forget every view (each is built again at its optimizer's next step)."""
        self.built.clear()
        self.generation += 1

    def unstepped(self, optimizers: Sequence[torch.optim.Optimizer]) -> tuple[str, ...]:
        """Return the layers with a trainable parameter in none of ``optimizers``: not measured."""
        held = set().union(*map(_held, optimizers))
        pairs = zip(self.layout.owner, self.layout.params, strict=True)
        rows = {o for o, p in pairs if p.requires_grad and id(p) not in held}
        return tuple(self.layout.layers[i] for i in sorted(rows))

    def _build(self, optimizer: torch.optim.Optimizer, key: tuple[int, ...]) -> OptimizerView:
        """Build the view of ``optimizer`` for the param_groups' sizes ``key``."""
        layout = self.layout
        held = _held(optimizer)
        keep = [id(p) in held and p.requires_grad for p in layout.params]
        params, index = layout.subset(keep)
        layers = sorted({i for i, k in zip(layout.owner, keep, strict=True) if k})
        layers.append(len(layout.layers))
        rows = torch.tensor(layers, dtype=torch.long, device=index.device)
        index = torch.searchsorted(rows, index)  # the subset's layers 0..k-1: dense segments
        dense = {layer: i for i, layer in enumerate(layers)}
        owner = tuple(dense[o] for o, k in zip(layout.owner, keep, strict=True) if k)
        positions = layout.unique_positions(keep)
        unique = torch.tensor(positions, dtype=torch.long, device=index.device)
        sizes = torch.tensor([float(p.numel()) for p in params], device=rows.device)
        numel = sizes.new_zeros(len(layers) - 1).index_add_(0, index, sizes)
        numel = torch.cat([numel, sizes.index_select(0, unique).sum().view(1)])
        self.generation += 1
        segments = HostSegments(owner, len(layers) - 1, positions)
        return OptimizerView(
            params=params,
            index=index,
            rows=rows,
            owner=owner,
            key=key,
            unique=unique,
            numel=numel,
            row_ids=tuple(layers),
            segments=segments,
            every_row=layers == list(range(len(layout.layers) + 1)),
        )

    def first_param(self, optimizer: torch.optim.Optimizer) -> nn.Parameter | None:
        """Return the parameter whose gradient tells whether ``optimizer`` zeroed its gradients.

        Returns:
            Its first tracked parameter, or ``None`` where it steps none.
        """
        view = self.current(optimizer)
        if view is not None:
            return view.params[0] if view.params else None
        held = _held(optimizer)
        return next((p for p in self.layout.params if id(p) in held), None)

    def layers(self, optimizer: torch.optim.Optimizer) -> frozenset[int]:
        """Return the layout rows ``optimizer`` steps (before a view: those in its param_groups)."""
        view = self.current(optimizer)  # a param_groups change bumps the generation
        if view is not None:
            return view.layer_ids
        held = _held(optimizer)
        pairs = zip(self.layout.owner, self.layout.params, strict=True)
        return frozenset(o for o, p in pairs if id(p) in held)


class ViewNorms:
    """Computes the L2 norms of an :class:`OptimizerView`'s gradients and weights per row.

    Under FSDP2 the norms of the shards are made whole.

    Args:
        shards: the FSDP2 plan that makes the statistics whole (``None``: not sharded).
        workspace: the ``|g|`` pass's buffer, reused every step.
    """

    def __init__(self, shards: ShardPlan | None, workspace: Workspace) -> None:
        self.shards = shards
        self.workspace = workspace

    def norms(
        self, view: OptimizerView, grads: list[torch.Tensor], *, weights: bool
    ) -> torch.Tensor:
        """Return ``[rows, GRAD_STATS]``: gradient (and with ``weights`` weight) norms, else NaN."""
        norms = [param_norms(grads, self.workspace)]
        if weights:
            norms.append(param_norms([to_local(p) for p in view.params], self.workspace))
        if self.shards is not None:
            norms = self.shards.reduce(norms=norms).norms
        num_layers = len(view.rows) - 1
        stats = norms[0].new_full((num_layers + 1, len(GRAD_STATS)), torch.nan)
        unique = None if view.distinct else view.unique  # the same sum, one gather fewer
        for column, values in zip((NORM, WEIGHT), norms, strict=False):
            stats[:, column] = segment_norm(values, view.index, num_layers, unique)
        return stats

    def weight_norms(self, view: OptimizerView) -> torch.Tensor:
        """Return the ``[rows]`` weight norms of ``view``, for the alarms' diagnosis."""
        norms = param_norms([to_local(p) for p in view.params], self.workspace)
        if self.shards is not None:
            (norms,) = self.shards.reduce(norms=[norms]).norms
        return segment_norm(norms, view.index, len(view.rows) - 1, view.unique)


class UpdateRatio:
    """Reads ``||w_after - w_before|| / ||w_before||`` per layer, over an optimizer step.

    It keeps, for each view, a copy of the weights from :meth:`keep` until :meth:`record`; the
    copy goes with its view.

    Args:
        shards: the FSDP2 plan that makes the norms whole, or ``None``.
        readers: called with each step's update before its ratio is read (the *stall* rule's
            feed), in order.
    """

    def __init__(self, shards: ShardPlan | None, readers: list[UpdateReader]) -> None:
        self.shards = shards
        self.readers = readers
        self.workspace = Workspace()  # the stacks of the updates' read, kept for the fit
        self._before: weakref.WeakKeyDictionary[OptimizerView, list[torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )
        self._weight_norms: weakref.WeakKeyDictionary[OptimizerView, torch.Tensor] = (
            weakref.WeakKeyDictionary()
        )

    def keep(self, view: OptimizerView, weight_norm: torch.Tensor) -> None:
        """Keep a copy of ``view``'s weights, and their norms per row, before the step."""
        weights = [to_local(p) for p in view.params]
        before = self._before.get(view)
        if before is None:
            before = [torch.empty_like(w) for w in weights]
            self._before[view] = before
        internals.foreach_copy_(before, weights)
        self._weight_norms[view] = weight_norm

    def record(self, optimizer: torch.optim.Optimizer, view: OptimizerView) -> ColumnValues | None:
        """Return each layer's ratio after the step; the :attr:`readers` read the update first.

        Returns:
            The ratios, or ``None`` where :meth:`keep` kept no weights for this step.
        """
        weight_norm = self._weight_norms.pop(view, None)
        if weight_norm is None:
            return None
        before = self._before[view]
        after = [to_local(p) for p in view.params]
        for read in self.readers:  # before update_norms, which overwrites ``before``
            read(optimizer, view, before, after)
        upd = update_norms(
            before, after, view.layer_index, shards=self.shards, workspace=self.workspace
        )
        ratio = upd / weight_norm.clamp_min(torch.finfo(upd.dtype).tiny)
        valid = (weight_norm > 0)[:, None]
        return ColumnValues(ratio[:, None], view.cells, valid)
