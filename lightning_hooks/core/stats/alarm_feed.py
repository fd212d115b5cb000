"""Hand the alarms the gradient norms of each optimizer step they run on.

The alarms run on their own cadence (``AlarmRules.evaluate_every_n_steps``, every step by
default). On a logging step :class:`AlarmFeed` hands on the norms the tracker just read; on a
quiet step it reads the dense gradients' norms itself, in one read with no host sync.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import torch

from lightning_hooks.core.alarms import TrainingAlarms
from lightning_hooks.core.ops import pointer_norms
from lightning_hooks.core.ops.grad_stats import LINEAR_IN_GRADIENT, NORM, ParamLayout, plain_grads
from lightning_hooks.core.ops.grouped_norms import GroupedNorms
from lightning_hooks.core.ops.tensors import foreach_norm
from lightning_hooks.core.stats.optimizer_view import (
    OptimizerView,
    OptimizerViews,
    Read,
    ViewNorms,
    adaptive,
)
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["AlarmFeed", "AlarmStep", "Clip", "Measured", "foreach_norms", "quiet_read"]


class Clip(NamedTuple):
    """Name the gradient clipping a run applies: the Trainer's two clipping settings."""

    bound: float
    """``gradient_clip_val``: the largest norm, or the largest value of an entry."""
    algorithm: str
    """``gradient_clip_algorithm``: ``"norm"`` or ``"value"``."""


class AlarmStep(NamedTuple):
    """Name the optimizer step whose gradient norms the alarms are handed."""

    number: int
    amp: bool
    """Whether an AMP loss scaler steps it: a non-finite gradient is then *amp_overflow*, the
    step the scaler skips, not *nonfinite*."""


class Measured(NamedTuple):
    """What the tracker read of a logging step that the alarms read too."""

    norms: torch.Tensor
    """The gradient L2 norms per layer, then the global one (the alarms' own copy)."""
    stepped: torch.Tensor | None
    """The rows some gradient reached at this step (``None``: every row)."""


class AlarmFeed:
    """Hand the alarms each step's gradient norms, on the steps their cadence runs them.

    Args:
        alarms: the alarms handed the norms.
        views: the tracker's own views: what each optimizer steps of its layout.
        norms: reads the gradient and weight norms of an optimizer's view.
        order: the layer rows as their output-gradient hooks fired (emptied per step).
        clip: the Trainer's gradient clipping, for the *explosion* rule (``None``: none).

    Example:
        >>> from torch import nn
        >>> from lightning_hooks.core import AlarmRules, GradFlowTracker
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with GradFlowTracker(model, [opt], alarms=AlarmRules()) as tracker:
        ...     tracker.registry.logging_step = False  # every step is a quiet step
        ...     model(torch.randn(16, 4)).pow(2).mean().backward()
        ...     tracker.observe(opt)
        ...     tracker.alarms.evaluated  # the feed read the step, the tracker did not
        1
    """

    def __init__(
        self,
        alarms: TrainingAlarms,
        views: OptimizerViews,
        norms: ViewNorms,
        order: list[int],
        clip: Clip | None,
    ) -> None:
        self.alarms = alarms
        self._views = views
        self._norms = norms
        self._order = order
        self._clip = clip
        self._sharded = norms.shards is not None  # FSDP2: the general path makes norms whole
        self._triton = alarms.rules.quiet_read == "triton"

    def due(self, step: int) -> bool:
        """Say whether the alarms' own cadence runs them on optimizer step ``step``."""
        return step % self.alarms.rules.evaluate_every_n_steps == 0

    def observe(
        self,
        optimizer: torch.optim.Optimizer,
        at: AlarmStep,
        measured: Measured | None,
        param_grad_scale: torch.Tensor | None,
    ) -> None:
        """Hand the alarms the norms of the gradients ``optimizer`` is about to apply.

        Call it on the steps :meth:`due` names, after the tracker observed the step.

        Args:
            optimizer: the optimizer about to step.
            at: the optimizer step the alarms are handed.
            measured: what the tracker read of a logging step; ``None`` on any other step.
            param_grad_scale: the loss scale the parameter gradients still carry, or ``None``.
        """
        view = self._views.view(optimizer)
        if not view.params:
            return
        alarms = self.alarms
        if alarms.evaluated < alarms.rules.diverge_early:  # from step 1
            alarms.set_adaptive(adaptive(optimizer, view.params))
        if measured is not None:
            self._prepare_quiet_read(view, param_grad_scale)
            self._send(view, measured.norms, measured.stepped, at)
            return
        # A quiet step: one read of the dense gradients' norms. A sparse or missing gradient, one
        # that still carries the loss scale, or sharded parameters take the general path.
        if param_grad_scale is None and not self._sharded and self._quiet(view, at):
            return
        stats = self._norms.norms(view, ParamLayout.grads(view.params), weights=False)
        if param_grad_scale is not None:
            stats[:, LINEAR_IN_GRADIENT] /= param_grad_scale
        valid = view.valid()
        self._send(view, stats[:, NORM], None if valid is None else valid[:, NORM], at)

    def _prepare_quiet_read(
        self, view: OptimizerView, param_grad_scale: torch.Tensor | None
    ) -> None:
        """Make the quiet steps' host copy and read on a logging step, not on a quiet step."""
        if param_grad_scale is None and not self._sharded:
            self.alarms.reserve(len(view.params))
            self._read(view)

    def _quiet(self, view: OptimizerView, at: AlarmStep) -> bool:
        """Read a quiet step's dense gradients' norms and send them to the alarms.

        Returns:
            ``True`` when the read was done; ``False`` for a missing or sparse gradient.
        """
        grads = plain_grads(view.params)
        if grads is None:
            return False
        try:
            norms = self._read(view)(grads)
        except Exception as error:  # a gradient set by hand, unlike its parameter; a Triton
            # that cannot launch the kernels: said once, then the multi-tensor read
            view.read = foreach_norms
            failed = "its kernels failed" if self._triton else "its stacks failed"
            _read_fallback(self._triton, f"{failed} ({type(error).__name__}: {error})")
            norms = foreach_norms(grads)
        self._send(view, norms, None, at, segmented=False)
        return True

    def _read(self, view: OptimizerView) -> Read:
        """:func:`quiet_read` of ``view``, made once per view."""
        if view.read is None:
            view.read = quiet_read(view, self._triton)
        return view.read

    def _send(
        self,
        view: OptimizerView,
        norms: torch.Tensor,
        stepped: torch.Tensor | None,
        at: AlarmStep,
        *,
        segmented: bool = True,
    ) -> None:
        """Hand ``norms`` to the alarms: per layer then global if ``segmented``, else per parameter.

        ``stepped`` holds the rows some gradient reached.
        """
        clip = self._clip  # the largest global norm the optimizer applies (by value: a bound)
        bound = None
        if clip is not None and clip.algorithm == "norm":
            bound = clip.bound
        elif clip is not None:
            bound = clip.bound * view.scale
        self.alarms.update(
            norms,
            view.row_ids,
            step=at.number,
            amp=at.amp,
            order=self._order,
            weights=partial(self._norms.weight_norms, view),
            stepped=stepped,
            clip=bound,
            segments=None if segmented else view.segments,
        )
        self._order.clear()


def quiet_read(view: OptimizerView, triton: bool) -> Read:
    """Return the read of ``view``'s gradient norms by ``AlarmRules.quiet_read``.

    One that cannot be made is said once and :func:`foreach_norms` reads instead.

    Args:
        view: the optimizer's view.
        triton: the ``"triton"`` read; else the ``"grouped"`` one.
    """
    try:
        read = _pointer_norms(view) if triton else GroupedNorms(view.params)
    except Exception as error:  # its index or tables not made (pinned memory, say)
        failed = "its tables could not be built" if triton else "it could not be made"
        read = f"{failed} ({type(error).__name__}: {error})"
    if isinstance(read, str):
        _read_fallback(triton, read, 4)
        return foreach_norms
    return read


def foreach_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Return each gradient's L2 norm, stacked, by one ``torch._foreach_norm`` (the last resort)."""
    return torch.stack(foreach_norm(list(grads)))


def _pointer_norms(view: OptimizerView) -> Read | str:
    """Return the pointer-table read of ``view``'s gradients, or why it cannot read them."""
    why = pointer_norms.available()
    if why is None and view.params[0].device.type != "cuda":
        why = f"the gradients are on {view.params[0].device.type}, not CUDA"
    if why is not None:
        return why
    try:
        return pointer_norms.PointerNorms(view.params)
    except ValueError as error:  # a layout it does not read
        return f"it reads {error}"


def _read_fallback(triton: bool, why: str, stacklevel: int = 3) -> None:
    """Say once, for one optimizer, why the quiet step reads with ``_foreach_norm``.

    ``triton`` tells whether the read that failed was ``"triton"`` or ``"grouped"``.
    """
    read = "triton" if triton else "grouped"
    warnings.warn(
        f"AlarmRules(quiet_read={read!r}): {why}; quiet steps read the gradients' norms with "
        "torch._foreach_norm instead",
        LightningHooksWarning,
        stacklevel=stacklevel,
    )
