"""The gradient with respect to each layer's output, measured per optimizer step."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple, Protocol, TypeVar

import torch
from torch import nn

from lightning_hooks import internals
from lightning_hooks.core.distributed import all_reduce_sum_, world_size
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.hooks.selection import compiled_regions
from lightning_hooks.core.ops.tensors import iter_float_tensors
from lightning_hooks.core.stats.optimizer_view import ColumnValues, OptimizerView, OptimizerViews

__all__ = ["OutputGradients"]


F = TypeVar("F", bound=Callable[..., Any])


class _NotedNorm(NamedTuple):
    """An eager gradient hook's output-gradient norm, held until a record sums it into its row."""

    sq_row: torch.Tensor  # the row of the sums of squares
    norm: torch.Tensor


Noted = list[_NotedNorm]
"""The eager gradient hooks' norms, until a record."""


class _Sums(NamedTuple):
    """The buffers where the output hooks of every layer add up."""

    sq: torch.Tensor  # [layers] sums of the squared norms
    hit: torch.Tensor  # [layers] the outputs hooked (compiled regions)
    noted: Noted  # the eager gradient hooks' norms
    hits: list[torch.Tensor]  # the eager forward hooks' rows of ``hit``, counted at record


class _Wrap(Protocol):
    """The type of the registry's guard, :meth:`HookRegistry.guarded`: ``fn``, errors caught."""

    def __call__(self, fn: F, where: str) -> F:
        """Return ``fn`` with its errors caught.

        Args:
            fn: the hook to guard.
            where: what the hook is, as the report of its error names it.

        Returns:
            The guarded hook.
        """
        ...


OutputHook = Callable[[nn.Module, tuple[Any, ...], object], None]


def _output_norm(grad: torch.Tensor) -> torch.Tensor:
    """Return the L2 norm of ``grad``, fp16 and bf16 summed in float32, float64 kept."""
    dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
    norm: torch.Tensor = torch.linalg.vector_norm(grad, dtype=dtype)
    return norm


def _add_output_grad(sq_row: torch.Tensor, grad: torch.Tensor) -> None:
    """Add the square of ``grad``'s norm into ``sq_row`` (a compiled region's hook)."""
    norm = _output_norm(grad)
    sq_row.addcmul_(norm, norm)


def _note_output_grad(
    noted: Noted, sq_row: torch.Tensor, order: list[int], row: int, grad: torch.Tensor
) -> None:
    """Note ``grad``'s norm for ``sq_row``, summed at record, and ``row`` in the backward order."""
    noted.append(_NotedNorm(sq_row, _output_norm(grad)))  # summed at record: one op for all
    order.append(row)  # host-side: the backward order the non-finite alarm names layers in


def _by_round(rows: list[torch.Tensor]) -> list[list[int]]:
    """Return the positions of ``rows`` in rounds of distinct rows.

    A multi-tensor op writes a row once.
    """
    rounds: list[list[int]] = []
    seen: dict[int, int] = {}
    for i, row in enumerate(rows):
        k = seen.get(id(row), -1) + 1
        seen[id(row)] = k
        if k == len(rounds):
            rounds.append([])
        rounds[k].append(i)
    return rounds


def _sum_noted(noted: Noted, hits: list[torch.Tensor]) -> None:
    """Add each noted norm's square and each hit into its row (one op per round); empties both."""
    for picks in _by_round([noted_norm.sq_row for noted_norm in noted]):
        norms = [noted[i].norm for i in picks]
        internals.foreach_addcmul_([noted[i].sq_row for i in picks], norms, norms)
    for picks in _by_round(hits):
        internals.foreach_add_([hits[i] for i in picks], 1.0)
    noted.clear()
    hits.clear()


def _output_hook(
    sums: _Sums, row: int, order: list[int], compiled_sq: list[torch.Tensor], wrap: _Wrap
) -> OutputHook:
    """Return a forward hook putting a gradient hook on the outputs of training forwards.

    Args:
        sums: where the hooks of every layer add up.
        row: the layer's row.
        order: the backward order of the rows, which the eager gradient hooks append to.
        compiled_sq: a cell with the tensor a compiled region sums into.
        wrap: the registry's guard, which catches the hooks' errors.

    Returns:
        The forward hook.
    """
    hits = sums.hits
    sq_row = sums.sq.select(0, row)
    hit_row = sums.hit.select(0, row)
    eager = partial(_note_output_grad, sums.noted, sq_row, order, row)
    eager = wrap(eager, "output gradient hook")  # made once

    def hook(module: nn.Module, args: tuple[Any, ...], output: object) -> None:
        # grad enabled, not the module's own training flag: a submodule the user put in eval
        # mode (a frozen backbone) gets gradients in the training forward too, and a checkpoint
        # recompute registers its outputs here
        if not torch.is_grad_enabled():
            return
        # Compiled: Dynamo cannot trace a host list mutated in backward (the non-finite alarm
        # falls back to reverse model order), and AOTAutograd checks the version of a tensor
        # the hook writes, which the eager hooks on ``sq`` would have bumped: each row sums into
        # its own tensor, lifted from the cell at each call (see OutputGradients).
        add = eager
        compiled = internals.is_compiling()
        if compiled:
            add = wrap(partial(_add_output_grad, compiled_sq[0]), "output gradient hook")
        for _, tensor in iter_float_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(add)  # type: ignore[no-untyped-call]
                if compiled:  # a count: a later step may take back what came before
                    hit_row.add_(1.0)
                else:  # counted at record
                    hits.append(hit_row)

    return hook


class OutputGradients:
    """Measures the L2 norm of the gradient with respect to each layer's output.

    Its square is summed over the backward passes of a step of one of ``optimizers``.
    :meth:`record` returns each step's norms; under DDP it keeps them, and
    :meth:`reduce_kept_steps` returns them summed across ranks. :attr:`order` is the backward
    order.

    Args:
        optimizers: the optimizers whose steps are measured.
        views: the optimizers' views over the layout, which give each step's rows.
    """

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        views: OptimizerViews,
    ) -> None:
        device = views.layout.index.device
        num_layers = len(views.layout.layers)
        self.optimizers = list(optimizers)
        self.views = views
        self.order: list[int] = []
        self._sq = torch.zeros(num_layers, device=device)
        self._hit = torch.zeros(num_layers, device=device)
        self._noted: Noted = []  # the eager gradient hooks' norms, summed into _sq at record
        self._hits: list[torch.Tensor] = []  # the eager forward hooks' rows of _hit, counted then
        # One tensor per row for compiled regions' gradient hooks (see _output_hook), in a cell;
        # a region called again in a step gets fresh ones: its first call's backward, run last,
        # checks that its tensor was not written since its forward.
        self._compiled_sq = [torch.zeros((), device=device) for _ in range(num_layers)]
        self._cells = [[t] for t in self._compiled_sq]
        self._extra: list[tuple[int, torch.Tensor]] = []  # the fresh tensors, until record
        self._called: set[int] = set()  # the compiled regions called since the last record
        # Several optimizers: the sums at another optimizer's last step, and the gradient each
        # optimizer's first parameter had then.
        self._pending_sq = torch.zeros_like(self._sq)
        self._pending_hit = torch.zeros_like(self._hit)
        self._markers: dict[int, weakref.ref[torch.Tensor] | None] = {}
        self._unowned: torch.Tensor | None = None  # rows no optimizer steps (frozen)
        self._unowned_at = -1  # the views' generation ``_unowned`` was made for
        self._series: list[torch.Tensor] = []  # DDP: each step's [squares | hits, layers]

    def hook(
        self, registry: HookRegistry, modules: Sequence[tuple[str, nn.Module]], model: nn.Module
    ) -> None:
        """Hook the output of each of ``modules`` that is a layer of the layout.

        Each compiled region of ``model`` gets a pre-hook giving its rows fresh tensors when called
        again.

        Args:
            registry: the registry the hooks go on.
            modules: ``(name, module)`` of the candidate modules.
            model: the model, whose compiled regions are found.
        """
        by_name = dict(modules)
        layers = self.views.layout.layers
        sums = _Sums(sq=self._sq, hit=self._hit, noted=self._noted, hits=self._hits)
        for row, name in enumerate(layers):
            if name not in by_name:
                continue  # the model's own row: its output is the loss's input, not a layer's
            hook = _output_hook(sums, row, self.order, self._cells[row], registry.guarded)
            registry.forward_hook(by_name[name], hook, gated=True)
        for name, region in compiled_regions(model):
            rows = [i for i, n in enumerate(layers) if n == name or n.startswith(f"{name}.")]
            if rows:
                registry.forward_pre_hook(region, partial(self._called_again, rows), gated=True)

    def _called_again(self, rows: list[int], region: nn.Module, args: tuple[Any, ...]) -> None:
        """Give a compiled region's rows fresh tensors, from its second call in a step on."""
        if not torch.is_grad_enabled():
            return
        if id(region) not in self._called:
            self._called.add(id(region))
            return
        for row in rows:
            fresh = torch.zeros((), device=self._sq.device)
            self._cells[row][0] = fresh
            self._extra.append((row, fresh))

    def record(
        self, optimizer: torch.optim.Optimizer, view: OptimizerView, grad_scale: torch.Tensor | None
    ) -> ColumnValues | None:
        """Return the output gradients' norms of ``optimizer``'s rows, at a logging step.

        Args:
            optimizer: the optimizer about to step.
            view: the optimizer's view, which gives the rows it steps.
            grad_scale: the AMP loss scale the gradients carry (``None``: none).

        Returns:
            The step's norms; ``None`` under DDP, where :meth:`reduce_kept_steps` returns them.
        """
        _sum_noted(self._noted, self._hits)
        for row, fresh in self._extra:
            self._compiled_sq[row].add_(fresh)
            self._cells[row][0] = self._compiled_sq[row]
        self._extra.clear()
        self._called.clear()
        self._sq.add_(torch.stack(self._compiled_sq))
        internals.foreach_zero_(self._compiled_sq)
        self._drop_other_backward(optimizer, view)
        norms = self._take(view, grad_scale)
        self._clear_unowned()
        if len(self.optimizers) > 1:
            self._mark_other_optimizers(optimizer)
        return norms

    def _mark_other_optimizers(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep the sums and each other optimizer's gradient, to find at its step what fed it."""
        self._pending_sq.copy_(self._sq)  # for the other optimizers' next steps
        self._pending_hit.copy_(self._hit)
        for other in self.optimizers:
            first = self.views.first_param(other) if other is not optimizer else None
            if first is not None:
                self._markers[id(other)] = None if first.grad is None else weakref.ref(first.grad)

    def _clear_unowned(self) -> None:
        """Zero the sums of rows no optimizer steps: a layer unfrozen later counts from then."""
        owned: set[int] = set().union(*map(self.views.layers, self.optimizers))
        if self._unowned is None or self._unowned_at != self.views.generation:  # groups changed
            rows = [i for i in range(self._sq.shape[0]) if i not in owned]
            self._unowned = torch.tensor(rows, dtype=torch.long, device=self._sq.device)
            self._unowned_at = self.views.generation
        if self._unowned.numel():
            self._sq.index_fill_(0, self._unowned, 0.0)
            self._hit.index_fill_(0, self._unowned, 0.0)

    def _drop_other_backward(self, optimizer: torch.optim.Optimizer, view: OptimizerView) -> None:
        """Drop what fed another optimizer's last step if zeroed since (several optimizers: GAN)."""
        if id(optimizer) not in self._markers:
            return
        marker = self._markers.pop(id(optimizer))
        then = marker() if marker is not None else None
        if then is not None and then is view.params[0].grad:
            return  # no zero_grad since: those passes feed this step too
        rows = view.rows[:-1]
        sq = (self._sq[rows] - self._pending_sq[rows]).clamp_(min=0.0)
        self._sq.index_copy_(0, rows, sq)
        self._hit.index_copy_(0, rows, self._hit[rows] - self._pending_hit[rows])

    def _take(self, view: OptimizerView, grad_scale: torch.Tensor | None) -> ColumnValues | None:
        """Return the step's unscaled norms of ``view``'s rows, and zero their sums.

        Under DDP they are kept for the epoch's one reduction, and ``None`` is returned.
        """
        cells = view.layer_cells  # the rows ``view`` steps (a slice: views, no gather)
        sq = self._sq[cells]
        if grad_scale is not None:
            sq = sq / grad_scale.square()
        norms = None
        if world_size() == 1:
            valid = self._hit[cells, None] > 0
            norms = ColumnValues(sq.sqrt()[:, None], cells, valid)
        else:  # under DDP: the step's rank-local squares, kept until the epoch's one reduction
            rows = view.rows[:-1]
            slot = self._sq.new_zeros(2, self._sq.shape[0])
            slot[0].index_copy_(0, rows, sq)
            slot[1].index_copy_(0, rows, self._hit[rows].to(slot.dtype))
            self._series.append(slot)
        self._sq[cells] = 0.0
        self._hit[cells] = 0.0
        return norms

    def reduce_kept_steps(self) -> ColumnValues | None:
        """Return the steps' output-gradient norms kept under DDP, summed across ranks.

        Returns:
            ``[steps, layers, 1]`` norms, or ``None`` where no step was kept.
        """
        if not self._series:
            return None
        series = all_reduce_sum_(torch.stack(self._series))
        norm = series[:, 0].sqrt() / world_size()
        rows = torch.arange(norm.shape[1], device=norm.device)
        valid = series[:, 1, :, None] > 0
        self.reset()
        return ColumnValues(norm[:, :, None], rows, valid)

    def reset(self) -> None:
        """Drop the steps kept for the reduction (a new accumulation period)."""
        self._series.clear()
