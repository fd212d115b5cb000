"""Gradient flow of a model, per layer, accumulated on the device: no Lightning here."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from lightning_hooks.core import checks
from lightning_hooks.core.alarms import AlarmRules, GradientAlarms
from lightning_hooks.core.hooks.registry import HookOwner, HookRegistry
from lightning_hooks.core.hooks.selection import ModuleTypes, Patterns
from lightning_hooks.core.kernels.grad_stats import (
    GLOBAL,
    GRAD_STATS,
    ParamLayout,
    grad_stats,
    param_norms,
    segment_norm,
    typical_update,
)
from lightning_hooks.core.kernels.grad_stats import update_norms as _update_norms
from lightning_hooks.core.kernels.tensors import Workspace, is_grad_forward, iter_float_tensors
from lightning_hooks.core.stats.accumulator import LayerStats, LayerStatsAccumulator
from lightning_hooks.core.transport.distributed import all_reduce_sum_, world_size
from lightning_hooks.core.transport.sharding import ShardPlan, to_local

__all__ = ["GRAD_FLOW_STATS", "GradFlowTracker"]

GRAD_FLOW_STATS = (*GRAD_STATS, "update_ratio", "output_grad_norm", "grad_norm_preclip")
"""Columns of the tracker's :class:`~lightning_hooks.core.LayerStats`. With ``post_clip`` the
``grad_*`` columns are the gradient the optimizer applied (after clipping) and
``grad_norm_preclip`` the L2 norm before clipping; without, ``grad_norm_preclip`` is empty."""

_UPDATE = GRAD_FLOW_STATS.index("update_ratio")
_OUTPUT = GRAD_FLOW_STATS.index("output_grad_norm")
_WEIGHT = GRAD_FLOW_STATS.index("weight_norm")
_PRECLIP = GRAD_FLOW_STATS.index("grad_norm_preclip")
_GRAD = slice(0, _WEIGHT)  # the gradient's columns of GRAD_STATS
_ALL = slice(0, len(GRAD_STATS))
_SCALED = slice(0, 3)  # grad_norm, grad_abs_mean, grad_abs_max: linear in the gradient


@dataclass
class _OptimizerView:
    """The tracked parameters one optimizer steps, and the buffers of its update ratio."""

    params: tuple[nn.Parameter, ...]
    index: torch.Tensor
    rows: torch.Tensor  # layers it steps, then the global row
    before: list[torch.Tensor]
    owner: tuple[int, ...]  # index, on the host
    key: tuple[int, ...]  # the param_groups' sizes it was built for
    unique: torch.Tensor  # positions of each parameter's first listing (global figures)
    numel: torch.Tensor  # [layers + 1] elements it steps per layer, then all (shared once)
    layer_ids: frozenset[int]  # the layout rows it steps, on the host
    weight_norm: torch.Tensor | None = None
    masks: dict[tuple[bool, ...], torch.Tensor] = field(default_factory=dict)

    def grad_mask(self, missing: tuple[bool, ...]) -> torch.Tensor:
        """``[layers + 1, len(GRAD_STATS)]``: false in the gradient columns of layers none of
        whose parameters has a gradient this step (built once per pattern, not per step)."""
        mask = self.masks.get(missing)
        if mask is None:
            has = [False] * (len(self.rows) - 1)
            for owner, gone in zip(self.owner, missing, strict=True):
                has[owner] = has[owner] or not gone
            table = [[h, h, h, h, True] for h in [*has, any(has)]]
            mask = torch.tensor(table, dtype=torch.bool, device=self.rows.device)
            self.masks[missing] = mask
        return mask


_SECOND_MOMENT = ("exp_avg_sq", "square_avg", "sum", "exp_avg_sq_row")
"""Optimizer state keys of a per-coordinate second moment (Adam/AdamW/NAdam/RAdam, RMSprop/
Adadelta, Adagrad, Adafactor): the optimizers whose update size per unit of learning rate does
not follow the gradient's, and which one explosion can stall (SGD's update is the gradient)."""


def _adaptive(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> bool:
    """Whether ``optimizer`` keeps a second moment for the first of ``params``."""
    state = optimizer.state.get(params[0], {}) if params else {}
    return any(key in state for key in _SECOND_MOMENT)


def _groups_key(optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    """The param_groups' sizes: a view is rebuilt when they change (``add_param_group``)."""
    return tuple(len(group["params"]) for group in optimizer.param_groups)


def _check_optimizers(optimizers: Any) -> list[torch.optim.Optimizer]:
    expected = "an iterable of torch.optim.Optimizer (e.g. [optimizer])"
    if isinstance(optimizers, torch.optim.Optimizer) or not isinstance(optimizers, Iterable):
        shown = f"{type(optimizers).__name__}(...)"  # an optimizer's repr spans many lines
        raise TypeError(f"GradFlowTracker(optimizers={shown}): must be {expected}, got {shown}")
    out = list(optimizers)
    for item in out:
        if not isinstance(item, torch.optim.Optimizer):
            raise TypeError(
                f"GradFlowTracker(optimizers=[...]): must be {expected}, got an item {item!r}"
            )
    return out


def _add_output_grad(sq_row: torch.Tensor, grad: torch.Tensor) -> None:
    # fp16/bf16 are summed in float32; float64 (precision="64-true") stays float64.
    dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm(grad, dtype=dtype)
    sq_row.addcmul_(norm, norm)


def _add_output_grad_at(sq: torch.Tensor, row: int, grad: torch.Tensor) -> None:
    _add_output_grad(sq.select(0, row), grad)


def _add_output_grad_in_order(
    sq_row: torch.Tensor, order: list[int], row: int, grad: torch.Tensor
) -> None:
    _add_output_grad(sq_row, grad)
    order.append(row)  # host-side: the backward order the non-finite alarm names layers in


def _output_hook(
    sq: torch.Tensor, hit: torch.Tensor, row: int, order: list[int], wrap: Any = None
) -> Any:
    """A forward hook that puts a gradient hook on the module's outputs in training forwards
    (``wrap``: the registry's guard for those tensor hooks)."""
    # Views made once: each step then costs one op per forward and two per gradient.
    sq_row, hit_row = sq.select(0, row), hit.select(0, row)

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not is_grad_forward(module):
            return
        # Dynamo cannot trace a host list mutated in backward, nor views made outside the
        # graph: compiled, the non-finite alarm falls back to reverse model order.
        if torch.compiler.is_compiling():
            add = partial(_add_output_grad_at, sq, row)
        else:
            add = partial(_add_output_grad_in_order, sq_row, order, row)
        if wrap is not None:
            add = wrap(add, "output gradient hook")
        for _, tensor in iter_float_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(add)  # type: ignore[no-untyped-call]
                hit_row.add_(1.0)  # a count: a later step may take back what came before

    return hook


class GradFlowTracker(HookOwner):
    """Per-layer gradient flow over optimizer steps, on the device, with no host sync per step.

    A layer is a module that owns trainable parameters directly. Per optimizer step it measures
    the gradient the optimizer applies (L2 norm, mean ``|g|``, max ``|g|``, any non-finite), the
    weight norm, the update-to-weight ratio ``||w_after - w_before|| / ||w_before||`` and the L2
    norm of the gradient with respect to the layer's outputs (summed in square over the
    micro-batches and calls of the step). :meth:`result` gives the mean and max over steps.

    Call :meth:`observe` just before ``optimizer.step()`` (and before any clipping); the update
    ratio is taken by an optimizer step post-hook, which runs after the clipping and the update,
    while ``p.grad`` still holds what the optimizer applied. With ``post_clip`` (gradients are
    clipped between :meth:`observe` and the step) the gradient columns are measured in that
    post-hook too, so they are what the optimizer applied, and ``grad_norm_preclip`` holds the
    L2 norm :meth:`observe` saw. Use it as a context manager, or call :meth:`remove`.

    Under ``torch.distributed`` (DDP) every rank must call :meth:`observe` and :meth:`result`.
    Parameter gradients are the all-reduced ones, the same on every rank: rank 0 records them.
    Output gradients are rank-local: their squares are kept per step and summed across ranks
    in one collective at :meth:`result`, then divided by the world size, which gives the output
    gradient of the rank-averaged loss that DDP's gradient averaging optimizes, i.e. what one
    process would measure on the global batch.

    Sampling: set :attr:`sampled` to ``False`` before a step's forward to skip that step; its
    hooks then return at once and :meth:`observe` records nothing. Under ``torch.compile`` the
    flag is guarded: each of its two values compiles once. The alarms (the sentinel) run on
    every ``AlarmRules.every_n_steps``-th step (every step by default), sampled or not: one
    multi-tensor L2 pass over the gradients (before clipping: clipping would hide a spike),
    segment-summed per layer on the device, which a sampled step reuses for its statistics. The
    weights are read only when a rule fired (to name where a NaN entered). On a step that is
    not sampled a non-finite gradient's layer is named in reverse model order (the backward
    order needs the output hooks).

    Args:
        model: the model to track.
        optimizers: optimizers whose steps give the update ratio (none: no update ratio).
        types: only modules of these types count as layers.
        include: glob patterns on module names to keep.
        exclude: glob patterns on module names to drop.
        update_ratio: measure the update ratio (keeps one copy of the parameters).
        output_grad: measure the gradient with respect to each layer's output.
        post_clip: gradients are clipped before the step: measure them in the step post-hook
            (what the optimizer applied), and the pre-clip norm in :meth:`observe`.
        clip: ``(gradient_clip_val, gradient_clip_algorithm)`` when the gradients are clipped
            before the step: the *explosion* rule judges the gradient as the optimizer applies
            it. With ``update_ratio``, the alarms' *stall* reads the update on sampled steps.
        alarms: evaluate these gradient alarm rules (see
            :class:`~lightning_hooks.core.GradientAlarms`); read them with ``tracker.alarms``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with GradFlowTracker(model, [opt]) as tracker:
        ...     for _ in range(3):
        ...         opt.zero_grad()
        ...         model(torch.randn(16, 4)).pow(2).mean().backward()
        ...         tracker.observe(opt)
        ...         opt.step()
        ...     stats = tracker.result()
        >>> stats.layers, stats.count[0].tolist()
        (('0', '2', 'global'), [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 0.0])
    """

    def __init__(
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
        clip: tuple[float, str] | None = None,
    ) -> None:
        checks.module("GradFlowTracker", "model", model)
        optimizers = _check_optimizers(optimizers)
        for name, flag in (
            ("update_ratio", update_ratio),
            ("output_grad", output_grad),
            ("post_clip", post_clip),
        ):
            checks.boolean("GradFlowTracker", name, flag)
        if alarms is not None and not isinstance(alarms, AlarmRules):
            raise TypeError(
                f"GradFlowTracker(alarms={alarms!r}): must be an AlarmRules or None, "
                f"got {type(alarms).__name__}"
            )
        self.registry = HookRegistry(model)
        modules = self.registry.modules(types=types, include=include, exclude=exclude)
        # The model's own parameters (a learnable temperature) unless a selection narrows it.
        root = model if types is None and not include else None
        self.layout = ParamLayout.from_modules(modules, root=root)
        self.workspace = Workspace()  # the |g| pass's buffer, reused every step
        if not self.layout.layers:
            raise ValueError(
                "GradFlowTracker: no selected module owns a parameter "
                f"(types={types!r}, include={include!r}, exclude={exclude!r})"
            )
        device = self.layout.index.device
        # FSDP2: parameters are DTensors; statistics of their shards are made whole per step.
        self.shards = ShardPlan.from_params(self.layout.params)
        self.accumulator = LayerStatsAccumulator((*self.layout.layers, GLOBAL), GRAD_FLOW_STATS)
        self.accumulator.to(device)
        num_layers = len(self.layout.layers)
        self._out_sq = torch.zeros(num_layers, device=device)
        self._hit = torch.zeros(num_layers, device=device)
        # Several optimizers: each row's output-gradient sums as they stood at the last step of
        # another optimizer, and the gradient each optimizer's first parameter had then.
        self._pending_sq = torch.zeros_like(self._out_sq)
        self._pending_hit = torch.zeros_like(self._hit)
        self._markers: dict[int, weakref.ref[torch.Tensor] | None] = {}
        self._optimizers = list(optimizers)
        self._unowned: torch.Tensor | None = None  # rows no optimizer steps (frozen)
        # Under DDP only: [steps, squared output-grad norm | hit, layers], reduced at result().
        self._series = torch.zeros(0, 2, num_layers, device=device)
        self._steps = 0
        self._output_grad = output_grad
        self._update_ratio = update_ratio
        self._post_clip = post_clip
        self._clip = clip
        self._step = 0  # the step of the last observe, which the step post-hook follows
        self._views: dict[int, _OptimizerView] = {}
        self._backward_order: list[int] = []
        self._calls = 0
        self.alarms = (
            GradientAlarms((*self.layout.layers, GLOBAL), alarms, device)
            if alarms is not None
            else None
        )
        if output_grad:
            by_name = dict(modules)
            for row, name in enumerate(self.layout.layers):
                if name not in by_name:
                    continue  # the model's own row: its output is the loss's input, not a layer's
                wrap = self.registry.guarded
                hook = _output_hook(self._out_sq, self._hit, row, self._backward_order, wrap)
                self.registry.forward_hook(by_name[name], hook, gated=True)
        for optimizer in optimizers:
            self.registry.optimizer_step_post_hook(optimizer, self._after_step)

    def unstepped(self) -> tuple[str, ...]:
        """Layers with a trainable parameter in none of the optimizers given: never measured."""
        held = {id(p) for o in self._optimizers for g in o.param_groups for p in g["params"]}
        rows = {
            o
            for o, p in zip(self.layout.owner, self.layout.params, strict=True)
            if p.requires_grad and id(p) not in held
        }
        return tuple(self.layout.layers[i] for i in sorted(rows))

    @property
    def sampled(self) -> bool:
        """Whether the current step is measured (default ``True``)."""
        return self.registry.sampled

    @sampled.setter
    def sampled(self, value: bool) -> None:
        self.registry.sampled = value

    def _view(self, optimizer: torch.optim.Optimizer) -> _OptimizerView:
        """The view of ``optimizer``, built at its own step only: what it steps is read from
        ``requires_grad`` then, which Lightning's ``toggle_optimizer`` turns off for every
        other optimizer's parameters (a GAN's generator while the discriminator steps)."""
        # Rebuilt when the param_groups change (add_param_group: BackboneFinetuning) and at
        # each reset (epoch): a parameter unfrozen by requires_grad alone counts from there.
        view = self._current_view(optimizer)
        if view is None:
            key = _groups_key(optimizer)
            view = self._views[id(optimizer)] = self._build_view(optimizer, key)
        return view

    def _current_view(self, optimizer: torch.optim.Optimizer) -> _OptimizerView | None:
        """The view built at ``optimizer``'s last step, if its param_groups are unchanged."""
        view = self._views.get(id(optimizer))
        if view is not None and view.key != _groups_key(optimizer):
            del self._views[id(optimizer)]
            self._unowned = None
            return None
        return view

    def _build_view(self, optimizer: torch.optim.Optimizer, key: tuple[int, ...]) -> _OptimizerView:
        stepped = {
            id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad
        }
        keep = [id(p) in stepped for p in self.layout.params]
        params, index = self.layout.subset(keep)
        layers = sorted({i for i, k in zip(self.layout.owner, keep, strict=True) if k})
        layers.append(len(self.layout.layers))
        rows = torch.tensor(layers, dtype=torch.long, device=index.device)
        # Re-number the subset's layers 0..k-1 so the segment reductions stay dense.
        index = torch.searchsorted(rows, index)
        before = [torch.empty_like(to_local(p)) for p in params] if self._update_ratio else []
        dense = {layer: i for i, layer in enumerate(layers)}
        owner = tuple(dense[o] for o, k in zip(self.layout.owner, keep, strict=True) if k)
        unique = self.layout.unique(keep)
        sizes = torch.tensor([float(p.numel()) for p in params], device=rows.device)
        numel = sizes.new_zeros(len(layers) - 1).index_add_(0, index, sizes)
        numel = torch.cat([numel, sizes.index_select(0, unique).sum().view(1)])
        self._unowned = None
        ids = frozenset(layers[:-1])
        return _OptimizerView(params, index, rows, before, owner, key, unique, numel, ids)

    @torch.no_grad()
    def observe(
        self,
        optimizer: torch.optim.Optimizer,
        grad_scale: torch.Tensor | None = None,
        param_grad_scale: torch.Tensor | None = None,
        *,
        step: int | None = None,
    ) -> None:
        """Record the gradients ``optimizer`` is about to apply (call just before its step).

        Args:
            optimizer: the optimizer about to step; only the parameters it holds are measured.
            grad_scale: the AMP loss scale the output gradients still carry (a tensor, read on
                the device), or ``None``.
            param_grad_scale: the loss scale the parameter gradients still carry (a fused
                optimizer unscales inside its step), or ``None`` when they are unscaled.
            step: the optimizer step the alarms name, and their cadence counts (default:
                count calls from 0).
        """
        checks.optimizer("GradFlowTracker.observe", "optimizer", optimizer)
        step = self._calls if step is None else step
        self._calls += 1
        self._step = step
        sampled = self.registry.sampled
        alarms = self.alarms
        if alarms is not None and step % alarms.rules.every_n_steps != 0:
            alarms = None
        if not (sampled or alarms):
            return
        view = self._view(optimizer)
        if not view.params:
            return
        grads = ParamLayout.grads(view.params)
        missing = tuple(p.grad is None for p in view.params)
        valid = view.grad_mask(missing) if any(missing) else None
        stats = self._step_stats(view, grads, full=sampled and not self._post_clip)
        if param_grad_scale is not None:
            stats[:, _SCALED] /= param_grad_scale
        norms = stats[:, 0]
        if sampled:
            if alarms is not None:  # the accumulator may write into ``stats`` in place
                norms = norms.clone()
            self._record_step(optimizer, view, stats, valid, grad_scale)
        if alarms is not None:  # last: what the optimizer step's post-hook reduces is set
            alarms.update(
                norms,
                view.rows,
                step=step,
                amp=grad_scale is not None,
                order=self._backward_order,
                weights=partial(self._weight_norms, view),
                stepped=None if valid is None else valid[:, 0],
                clip=self._clip_norm(view),
            )
        self._backward_order.clear()

    def _record_step(
        self,
        optimizer: torch.optim.Optimizer,
        view: _OptimizerView,
        stats: torch.Tensor,
        valid: torch.Tensor | None,
        grad_scale: torch.Tensor | None,
    ) -> None:
        """A sampled step: its statistics into the accumulator, the weights kept for the
        update ratio (reduced in the optimizer step's post-hook), the output gradients."""
        if self._post_clip:  # the gradient the optimizer applies is read in the step post-hook
            cells = None if valid is None else valid[:, [0, _WEIGHT]]
            values = stats[:, [0, _WEIGHT]]
            self.accumulator.update(values, [_PRECLIP, _WEIGHT], view.rows, cells, replicated=True)
        else:
            self.accumulator.update(stats, _ALL, view.rows, valid, replicated=True)
        if self._update_ratio:
            torch._foreach_copy_(view.before, [to_local(p) for p in view.params])
            view.weight_norm = stats[:, _WEIGHT]
        if self._output_grad:
            self._drop_other_backward(optimizer, view)
            self._observe_output_grad(view.rows[:-1], grad_scale)
            self._clear_unowned()
            self._mark_other_optimizers(optimizer)

    def _clip_norm(self, view: _OptimizerView) -> float | None:
        """The largest global norm the optimizer will apply under ``clip`` (by value: a bound,
        the value times the square root of the number of entries)."""
        if self._clip is None:
            return None
        value, algorithm = self._clip
        return value if algorithm == "norm" else value * sum(p.numel() for p in view.params) ** 0.5

    def _step_stats(
        self, view: _OptimizerView, grads: list[torch.Tensor], *, full: bool
    ) -> torch.Tensor:
        """``[rows, GRAD_STATS]``: every column (``full``), else the sentinel's: the gradient
        L2 norm (one multi-tensor pass), and on a sampled step under clipping the weight norm,
        in one collective under FSDP2."""
        if full:
            return self._gradient_stats(view, grads)
        norms = [param_norms(grads)]
        if self._post_clip and self.registry.sampled:
            norms.append(param_norms([to_local(p) for p in view.params]))
        if self.shards is not None:
            norms = self.shards.reduce(norms=norms)[0]
        num_layers = len(view.rows) - 1
        stats = norms[0].new_full((num_layers + 1, len(GRAD_STATS)), torch.nan)
        for column, values in zip((0, _WEIGHT), norms, strict=False):
            stats[:, column] = segment_norm(values, view.index, num_layers, view.unique)
        return stats

    def _weight_norms(self, view: _OptimizerView) -> torch.Tensor:
        """``[rows]`` weight norms of ``view``: the alarms' attribution pass."""
        norms = param_norms([to_local(p) for p in view.params])
        if self.shards is not None:
            norms = self.shards.reduce(norms=[norms])[0][0]
        return segment_norm(norms, view.index, len(view.rows) - 1, view.unique)

    def _clear_unowned(self) -> None:
        """Zero the output-gradient sums of rows no optimizer steps (a frozen layer's output
        still gets a gradient): unfrozen later, it counts from its first step, not before.
        An optimizer that has not stepped yet owns every layer in its param_groups."""
        owned: set[int] = set()
        for other in self._optimizers:
            view = self._current_view(other)  # a param_groups change resets ``_unowned``
            owned |= view.layer_ids if view is not None else self._layers_in(other)
        if self._unowned is None:
            rows = [i for i in range(len(self.layout.layers)) if i not in owned]
            self._unowned = torch.tensor(rows, dtype=torch.long, device=self._out_sq.device)
        if self._unowned.numel():
            self._out_sq.index_fill_(0, self._unowned, 0.0)
            self._hit.index_fill_(0, self._unowned, 0.0)

    def _drop_other_backward(self, optimizer: torch.optim.Optimizer, view: _OptimizerView) -> None:
        """Under several optimizers (a GAN), take back from this optimizer's rows what the
        backward passes before another optimizer's last step put there, if this optimizer
        zeroed its gradients since (its first parameter holds another gradient tensor): those
        passes fed the other step, not this one. Two device ops; nothing with one optimizer."""
        if id(optimizer) not in self._markers:
            return
        marker = self._markers.pop(id(optimizer))
        then = marker() if marker is not None else None
        if then is not None and then is view.params[0].grad:
            return  # no zero_grad since: those passes feed this step too
        rows = view.rows[:-1]
        sq = (self._out_sq[rows] - self._pending_sq[rows]).clamp_(min=0.0)
        self._out_sq.index_copy_(0, rows, sq)
        self._hit.index_copy_(0, rows, self._hit[rows] - self._pending_hit[rows])

    def _mark_other_optimizers(self, optimizer: torch.optim.Optimizer) -> None:
        if len(self._optimizers) < 2:
            return
        self._pending_sq.copy_(self._out_sq)
        self._pending_hit.copy_(self._hit)
        for other in self._optimizers:
            first = self._first_param(other) if other is not optimizer else None
            if first is not None:
                grad = first.grad
                self._markers[id(other)] = weakref.ref(grad) if grad is not None else None

    def _first_param(self, optimizer: torch.optim.Optimizer) -> nn.Parameter | None:
        """The parameter whose gradient tells whether ``optimizer`` zeroed its gradients: its
        view's first, or before its first step the first tracked one in its param_groups."""
        view = self._current_view(optimizer)
        if view is not None:
            return view.params[0] if view.params else None
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return next((p for p in self.layout.params if id(p) in held), None)

    def _layers_in(self, optimizer: torch.optim.Optimizer) -> frozenset[int]:
        """The layout rows with a parameter in ``optimizer``'s param_groups."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        rows = (
            o for o, p in zip(self.layout.owner, self.layout.params, strict=True) if id(p) in held
        )
        return frozenset(rows)

    def _gradient_stats(
        self, view: _OptimizerView, grads: list[torch.Tensor], *, weights: bool = True
    ) -> torch.Tensor:
        """:func:`grad_stats` of ``view`` (``weights``: also the weight norms)."""
        params = [to_local(p) for p in view.params] if weights else None
        numel, total = view.numel[:-1], view.numel[-1]
        return grad_stats(
            grads,
            params,
            view.index,
            numel,
            unique=view.unique,
            total_numel=total,
            shards=self.shards,
            workspace=self.workspace,
        )

    def _observe_output_grad(self, rows: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
        sq = self._out_sq[rows]
        if grad_scale is not None:
            sq = sq / grad_scale.square()
        if world_size() == 1:
            valid = self._hit[rows, None] > 0
            self.accumulator.update(sq.sqrt()[:, None], [_OUTPUT], rows, valid, replicated=True)
        else:
            self._record_output_grad(rows, sq)
        self._out_sq.index_fill_(0, rows, 0.0)
        self._hit.index_fill_(0, rows, 0.0)

    def _record_output_grad(self, rows: torch.Tensor, sq: torch.Tensor) -> None:
        """Under DDP: keep the step's rank-local squares until the epoch's one reduction."""
        if self._steps == self._series.shape[0]:
            grown = self._series.new_zeros(max(16, 2 * self._steps), *self._series.shape[1:])
            grown[: self._steps] = self._series
            self._series = grown
        slot = self._series[self._steps]
        slot[0].index_copy_(0, rows, sq)
        slot[1].index_copy_(0, rows, self._hit[rows].to(slot.dtype))
        self._steps += 1

    def _flush_output_grad(self) -> None:
        """Reduce the per-step output-gradient squares across ranks into the accumulator."""
        if self._steps == 0:
            return
        series = all_reduce_sum_(self._series[: self._steps].clone())
        norm = series[:, 0].sqrt() / world_size()
        rows = torch.arange(norm.shape[1], device=norm.device)
        valid = series[:, 1, :, None] > 0
        self.accumulator.update(norm[:, :, None], [_OUTPUT], rows, valid, replicated=True)
        self._series.zero_()
        self._steps = 0

    @torch.no_grad()
    def _after_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        view = self._views.get(id(optimizer))
        if view is None or not view.params or not self.registry.sampled:
            return
        if self._post_clip:
            # After clipping and the update, p.grad still holds what the optimizer applied.
            missing = tuple(p.grad is None for p in view.params)
            valid = view.grad_mask(missing) if any(missing) else None
            grads = ParamLayout.grads(view.params)
            stats = self._gradient_stats(view, grads, weights=False)[:, _GRAD]
            cells = None if valid is None else valid[:, _GRAD]
            self.accumulator.update(stats, _GRAD, view.rows, cells, replicated=True)
        if view.weight_norm is None:
            return
        num_layers = len(view.rows) - 1
        after = [to_local(p) for p in view.params]
        if self.alarms is not None and _adaptive(optimizer, view.params):
            # before update_norms, which overwrites view.before; a logging step only
            lr = max(float(g["lr"]) for g in optimizer.param_groups)
            applied: list[torch.Tensor | None] = [
                to_local(p.grad) if p.grad is not None else None for p in view.params
            ]
            typical = typical_update(view.before, after, applied)
            self.alarms.update_stall(typical, lr, step=self._step)
        upd = _update_norms(
            view.before, after, view.index, num_layers, unique=view.unique, shards=self.shards
        )
        ratio = upd / view.weight_norm.clamp_min(torch.finfo(upd.dtype).tiny)
        valid = (view.weight_norm > 0)[:, None]
        self.accumulator.update(ratio[:, None], [_UPDATE], view.rows, valid, replicated=True)
        view.weight_norm = None

    def result(self) -> LayerStats:
        """Mean and max over the epoch's observed steps (reduced across ranks), on the host.

        Under ``torch.distributed`` this is two collectives, whatever the number of layers.
        """
        self._flush_output_grad()
        return self.accumulator.result()

    def post_window(self, step: int) -> None:
        """A logging point: post the window of steps since the last one (one collective, one
        copy, see :meth:`LayerStat.post_window`); :meth:`read_window` returns it."""
        self._flush_output_grad()
        self.accumulator.post_window(step)

    def read_window(self, wait: bool) -> tuple[int, LayerStats] | None:
        """``(step, stats)`` of the posted window once its copy is done (``wait``: block)."""
        return self.accumulator.read_window(wait)

    def state(self) -> dict[str, Any]:
        """The epoch so far, reduced across ranks, on the host (for a checkpoint)."""
        self._flush_output_grad()
        return self.accumulator.host_state()

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue the epoch :meth:`state` saved (same layers and statistics, else ValueError)."""
        self.accumulator.load_host_state(state)

    def reset(self) -> None:
        """Start a new accumulation period (an epoch); parameters are looked up afresh."""
        self.accumulator.reset()
        self._views.clear()
        self._unowned = None
        self._series.zero_()
        self._steps = 0
