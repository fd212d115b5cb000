"""Gradient flow of a model, per layer, accumulated on the device: no Lightning here."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any

import torch
from torch import nn

from lightning_hooks.core.accumulator import LayerStats, LayerStatsAccumulator
from lightning_hooks.core.grad_stats import GLOBAL, GRAD_STATS, ParamLayout, grad_stats
from lightning_hooks.core.grad_stats import update_norms as _update_norms
from lightning_hooks.core.registry import HookRegistry
from lightning_hooks.core.selection import ModuleTypes, Patterns
from lightning_hooks.core.tensors import is_training_forward, iter_float_tensors

__all__ = ["GRAD_FLOW_STATS", "GradFlowTracker"]

GRAD_FLOW_STATS = (*GRAD_STATS, "update_ratio", "output_grad_norm")
"""Columns of the tracker's :class:`~lightning_hooks.core.LayerStats`."""

_UPDATE = GRAD_FLOW_STATS.index("update_ratio")
_OUTPUT = GRAD_FLOW_STATS.index("output_grad_norm")
_WEIGHT = GRAD_FLOW_STATS.index("weight_norm")


@dataclass
class _OptimizerView:
    """The tracked parameters one optimizer steps, and the buffers of its update ratio."""

    params: tuple[nn.Parameter, ...]
    index: torch.Tensor
    rows: torch.Tensor  # layers it steps, then the global row
    before: list[torch.Tensor]
    weight_norm: torch.Tensor | None = None


class _Gate:
    """Whether the current step is measured: a plain Python flag the hooks read first."""

    __slots__ = ("open",)

    def __init__(self) -> None:
        self.open = True


def _add_output_grad(sq_row: torch.Tensor, grad: torch.Tensor) -> None:
    norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
    sq_row.addcmul_(norm, norm)


def _output_hook(sq: torch.Tensor, hit: torch.Tensor, row: int, gate: _Gate) -> Any:
    """A forward hook that puts a gradient hook on the module's outputs in training forwards."""
    # Views made once: each step then costs one op per forward and two per gradient.
    sq_row, hit_row = sq.select(0, row), hit.select(0, row)

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        if not gate.open or not is_training_forward(module):
            return
        for _, tensor in iter_float_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(partial(_add_output_grad, sq_row))  # type: ignore[no-untyped-call]
                hit_row.fill_(True)

    return hook


class GradFlowTracker:
    """Per-layer gradient flow over optimizer steps, on the device, with no host sync per step.

    A layer is a module that owns trainable parameters directly. Per optimizer step it measures
    the gradient the optimizer applies (L2 norm, mean ``|g|``, max ``|g|``, non-finite count), the
    weight norm, the update-to-weight ratio ``||w_after - w_before|| / ||w_before||`` and the L2
    norm of the gradient with respect to the layer's outputs (summed in square over the
    micro-batches and calls of the step). :meth:`result` gives the mean and max over steps.

    Call :meth:`observe` just before ``optimizer.step()``; the update ratio is taken by an
    optimizer step post-hook. Use it as a context manager, or call :meth:`remove`.

    Sampling: set :attr:`sampled` to ``False`` before a step's forward to skip that step; its
    hooks then return at once and :meth:`observe` does nothing. Under ``torch.compile`` the flag
    is guarded: each of its two values compiles once.

    Args:
        model: the model to track.
        optimizers: optimizers whose steps give the update ratio (none: no update ratio).
        types: only modules of these types count as layers.
        include: glob patterns on module names to keep.
        exclude: glob patterns on module names to drop.
        update_ratio: measure the update ratio (keeps one copy of the parameters).
        output_grad: measure the gradient with respect to each layer's output.

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
        (('0', '2', 'global'), [3.0, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0])
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
    ) -> None:
        self.registry = HookRegistry(model)
        modules = self.registry.modules(types=types, include=include, exclude=exclude)
        self.layout = ParamLayout.from_modules(modules)
        if not self.layout.layers:
            raise ValueError(
                "GradFlowTracker: no selected module owns a trainable parameter "
                f"(types={types!r}, include={include!r}, exclude={exclude!r})"
            )
        device = self.layout.index.device
        self.accumulator = LayerStatsAccumulator((*self.layout.layers, GLOBAL), GRAD_FLOW_STATS)
        self.accumulator.to(device)
        num_layers = len(self.layout.layers)
        self._out_sq = torch.zeros(num_layers, device=device)
        self._hit = torch.zeros(num_layers, dtype=torch.bool, device=device)
        self._update_ratio = update_ratio
        self._views: dict[int, _OptimizerView] = {}
        self._gate = _Gate()
        if output_grad:
            by_name = dict(modules)
            for row, name in enumerate(self.layout.layers):
                hook = _output_hook(self._out_sq, self._hit, row, self._gate)
                self.registry.forward_hook(by_name[name], hook)
        for optimizer in optimizers:
            self.registry.optimizer_step_post_hook(optimizer, self._after_step)

    @property
    def sampled(self) -> bool:
        """Whether the current step is measured (default ``True``)."""
        return self._gate.open

    @sampled.setter
    def sampled(self, value: bool) -> None:
        self._gate.open = value

    def _view(self, optimizer: torch.optim.Optimizer) -> _OptimizerView:
        view = self._views.get(id(optimizer))
        if view is None:
            stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
            keep = [id(p) in stepped for p in self.layout.params]
            params, index = self.layout.subset(keep)
            layers = sorted({i for i, k in zip(self.layout.owner, keep, strict=True) if k})
            layers.append(len(self.layout.layers))
            rows = torch.tensor(layers, dtype=torch.long, device=index.device)
            # Re-number the subset's layers 0..k-1 so the segment reductions stay dense.
            index = torch.searchsorted(rows, index)
            before = [torch.empty_like(p) for p in params] if self._update_ratio else []
            view = _OptimizerView(params, index, rows, before)
            self._views[id(optimizer)] = view
        return view

    @torch.no_grad()
    def observe(
        self, optimizer: torch.optim.Optimizer, grad_scale: torch.Tensor | None = None
    ) -> None:
        """Record the gradients ``optimizer`` is about to apply (call just before its step).

        Args:
            optimizer: the optimizer about to step; only the parameters it holds are measured.
            grad_scale: the AMP loss scale the output gradients still carry (a tensor, read on
                the device), or ``None``. Parameter gradients must already be unscaled.
        """
        if not self._gate.open:
            return
        view = self._view(optimizer)
        if not view.params:
            return
        grads = [p.grad if p.grad is not None else p.new_zeros(1) for p in view.params]
        # The update-ratio buffers are free until the copy below: reuse them as scratch.
        scratch = view.before if all(p.grad is not None for p in view.params) else None
        numel = self.layout.numel[view.rows[:-1]]
        stats = grad_stats(grads, view.params, view.index, numel, scratch or None)
        self.accumulator.update(stats, slice(0, len(GRAD_STATS)), view.rows)
        if self._update_ratio:
            torch._foreach_copy_(view.before, list(view.params))
            view.weight_norm = stats[:, _WEIGHT]
        self._observe_output_grad(view.rows[:-1], grad_scale)

    def _observe_output_grad(self, rows: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
        norm = self._out_sq[rows].sqrt()
        if grad_scale is not None:
            norm = norm / grad_scale
        self.accumulator.update(norm[:, None], [_OUTPUT], rows, valid=self._hit[rows, None])
        self._out_sq.index_fill_(0, rows, 0.0)
        self._hit.index_fill_(0, rows, False)

    @torch.no_grad()
    def _after_step(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        view = self._views.get(id(optimizer))
        if view is None or view.weight_norm is None:
            return
        num_layers = len(view.rows) - 1
        upd = _update_norms(view.before, view.params, view.index, num_layers)
        ratio = upd / view.weight_norm.clamp_min(torch.finfo(upd.dtype).tiny)
        valid = (view.weight_norm > 0)[:, None]
        self.accumulator.update(ratio[:, None], [_UPDATE], view.rows, valid=valid)
        view.weight_norm = None

    def result(self) -> LayerStats:
        """Mean and max over the observed steps (reduced across ranks), copied to the host."""
        return self.accumulator.result()

    def reset(self) -> None:
        """Start a new accumulation period (an epoch)."""
        self.accumulator.reset()

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        self.registry.remove()

    def __enter__(self) -> GradFlowTracker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()
