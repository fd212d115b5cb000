"""The gradient norms that the alarms get, on each optimizer step they run on.

The alarms run on their own cadence (``AlarmRules.evaluate_every_n_steps``, every step by
default), whatever the tracker's logging steps. On a logging step :class:`AlarmFeed` passes on
the norms the tracker just read; on a quiet step it reads the dense gradients' norms itself, in
one read with no host sync.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple, Protocol

import torch

from lightning_hooks.core.alarms import AlarmRules, TrainingAlarms
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.clipping import Clip
from lightning_hooks.core.ops import pointer_norms
from lightning_hooks.core.ops.grad_stats import (
    LINEAR_IN_GRADIENT,
    NORM,
    ParamLayout,
    plain_grads,
)
from lightning_hooks.core.ops.grouped_norms import GroupedNorms, typical_update
from lightning_hooks.core.ops.tensors import foreach_norm
from lightning_hooks.core.sharding import to_local
from lightning_hooks.core.stats.optimizer_view import (
    OptimizerView,
    OptimizerViews,
    Read,
    UpdateReader,
    ViewNorms,
    adaptive,
)
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.tags import GLOBAL

__all__ = ["AlarmFeed", "Measured", "Tracked", "foreach_norms", "quiet_read"]


class _Step(NamedTuple):
    """The optimizer step whose gradient norms the alarms are passed."""

    number: int
    amp: bool
    """Whether an AMP loss scaler steps it: a non-finite gradient is then *amp_overflow*, the
    step the scaler skips, not *nonfinite*."""
    clip: Clip | None
    """The gradient clipping it applies, for the *explosion* rule."""
    order: tuple[int, ...]
    """The layer rows in the order their output-gradient hooks fired in its backward (a
    logging step's; empty on another step, where the hooks do not run)."""


class Measured(NamedTuple):
    """What a tracker read of a logging step that the alarms read too."""

    norms: torch.Tensor
    """The gradient L2 norms per layer, then the global one (the alarms' own copy)."""
    stepped: torch.Tensor | None
    """The rows some gradient reached at this step (``None``: every row)."""
    order: tuple[int, ...]
    """The layer rows in the order their output-gradient hooks fired in the backward."""


class Tracked(Protocol):
    """What :class:`AlarmFeed` reads of a :class:`~.grad_flow.GradFlowTracker`."""

    views: OptimizerViews
    """What each optimizer steps of the tracker's layout."""
    view_norms: ViewNorms
    """Reads the gradient and weight norms of an optimizer's view."""

    def add_update_reader(self, read: UpdateReader) -> None:
        """Call ``read`` with each logging step's update, before its update ratio is read."""


@named_arguments
class AlarmFeed:
    """Gives the alarms each step's gradient norms, on the steps their cadence runs them.

    Call :meth:`observe` after the tracker observed the step, with what the tracker measured. On
    the logging steps of an adaptive optimizer the feed also hands the *stall* rule the step's
    typical update, which the tracker's update ratio reads.

    Args:
        tracker: the tracker whose layout, views and updates the feed reads. The feed adds
            itself to the tracker's update readers (``add_update_reader``), which the tracker
            calls with each logging step's update once measured.
        rules: the alarm rules; :attr:`training_alarms` applies them.

    Example:
        >>> from torch import nn
        >>> from lightning_hooks.core import AlarmRules, GradFlowTracker
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> with GradFlowTracker(model, [opt]) as tracker:
        ...     feed = AlarmFeed(tracker, AlarmRules())
        ...     tracker.registry.set_logging_step(False)  # every step is a quiet step
        ...     model(torch.randn(16, 4)).pow(2).mean().backward()
        ...     feed.observe(opt, tracker.observe(opt))
        ...     feed.training_alarms.evaluated  # the feed read the step, the tracker did not
        1
    """

    def __init__(self, tracker: Tracked, rules: AlarmRules) -> None:
        layout = tracker.views.layout
        self.training_alarms = TrainingAlarms((*layout.layers, GLOBAL), rules, layout.index.device)
        """The alarms the feed hands the norms to."""
        self._views = tracker.views
        self._norms = tracker.view_norms
        self._sharded = self._norms.shards is not None  # FSDP2: the general path makes norms whole
        self._triton = rules.quiet_read == "triton"
        self._step = 0
        """The optimizer step observed last. The update the tracker reads after that step's
        ``optimizer.step()`` (:meth:`_read_update`) belongs to it, so *stall* names it."""
        self._calls = 0
        self._reads: weakref.WeakKeyDictionary[OptimizerView, Read] = weakref.WeakKeyDictionary()
        """Each view's quiet read, made once; it goes with its view."""
        self._own_steps: weakref.WeakKeyDictionary[OptimizerView, int] = weakref.WeakKeyDictionary()
        """Each optimizer's next step of its own (:meth:`_own_step`)."""
        tracker.add_update_reader(self._read_update)

    def due(self, step: int) -> bool:
        """Return whether the alarms' own cadence runs them on an optimizer's step ``step``.

        With several optimizers, ``step`` counts one optimizer's own steps (:meth:`observe`).
        """
        return step % self.training_alarms.rules.evaluate_every_n_steps == 0

    def observe(  # noqa: PLR0913 (one optimizer step's facts, a keyword each, as a public method)
        self,
        optimizer: torch.optim.Optimizer,
        measured: Measured | None,
        *,
        step: int | None = None,
        grad_scale: torch.Tensor | None = None,
        param_grad_scale: torch.Tensor | None = None,
        clip: Clip | None = None,
    ) -> None:
        """Pass the alarms the norms of the gradients ``optimizer`` is about to apply.

        Call it on every optimizer step, after the tracker observed it; it reads the steps
        :meth:`due` names.

        Args:
            optimizer: the optimizer about to step.
            measured: what the tracker's ``observe`` returned: its reading of a logging step,
                else ``None``.
            step: the optimizer step the alarms name and count (default: calls from 0).
            grad_scale: the AMP loss scale, or ``None``. A non-finite gradient under it is
                *amp_overflow*, the step the scaler skips, not *nonfinite*.
            param_grad_scale: the loss scale the parameter gradients still carry, or ``None``.
            clip: the gradient clipping this step applies, for the *explosion* rule (``None``:
                none). Under Fabric its bound may change from one step to the next.
        """
        step = self._calls if step is None else step
        self._step = step
        self._calls += 1
        view = self._views.view(optimizer)
        if not self.due(self._own_step(view, step)):
            return
        if not view.params:
            return
        alarms = self.training_alarms
        # Whether the optimizer is adaptive is read over diverging's early steps only, the
        # steps whose bar depends on it.
        if alarms.evaluated < alarms.rules.diverge_early:
            alarms.set_adaptive(adaptive(optimizer, view.params))
        order = () if measured is None else measured.order
        at = _Step(step, amp=grad_scale is not None, clip=clip, order=order)
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

    def _own_step(self, view: OptimizerView, step: int) -> int:
        """Return the step of ``view``'s optimizer alone that optimizer step ``step`` is.

        One optimizer's own steps are the optimizer steps; several optimizers share them (two a
        batch: the first steps on the even ones, the second on the odd ones), and each is
        evaluated on every ``evaluate_every_n_steps``-th of its own. An optimizer's own steps
        count on from the step it was first observed at, so a resumed fit keeps the cadence.
        """
        number = self._own_steps.get(view, step)
        self._own_steps[view] = number + 1
        return number

    def _read_update(
        self,
        optimizer: torch.optim.Optimizer,
        view: OptimizerView,
        before: list[torch.Tensor],
        after: list[torch.Tensor],
    ) -> None:
        """Pass *stall* a logging step's typical update, for an adaptive optimizer only.

        ``before`` holds the weights before the step, until the update ratio reads it.
        """
        if not adaptive(optimizer, view.params):
            return
        lr = max(float(g["lr"]) for g in optimizer.param_groups)
        applied: list[torch.Tensor | None] = [
            to_local(p.grad) if p.grad is not None else None for p in view.params
        ]
        update = typical_update(before, after, applied)
        self.training_alarms.update_stall(update, lr, step=self._step)

    def _prepare_quiet_read(
        self, view: OptimizerView, param_grad_scale: torch.Tensor | None
    ) -> None:
        """Make the quiet steps' host copy and read on a logging step, not on a quiet step."""
        if param_grad_scale is None and not self._sharded:
            self.training_alarms.reserve(len(view.params))
            self._read(view)

    def _quiet(self, view: OptimizerView, at: _Step) -> bool:
        """Read a quiet step's dense gradients' norms and send them to the alarms.

        Returns:
            ``True`` when the read was done; ``False`` for a missing or sparse gradient.
        """
        grads = plain_grads(view.params)
        if grads is None:
            return False
        try:
            norms = self._read(view)(grads)
        except Exception as error:
            # A gradient set by hand unlike its parameter, or Triton kernels that cannot
            # launch: the feed says so once, then reads with the multi-tensor norm from now on.
            self._reads[view] = foreach_norms
            failed = "its kernels failed" if self._triton else "its stacks failed"
            _read_fallback(self._triton, f"{failed} ({type(error).__name__}: {error})")
            norms = foreach_norms(grads)
        self._send(view, norms, None, at, segmented=False)
        return True

    def _read(self, view: OptimizerView) -> Read:
        """:func:`quiet_read` of ``view``, made once per view."""
        read = self._reads.get(view)
        if read is None:
            read = quiet_read(view, self._triton)
            self._reads[view] = read
        return read

    def _send(
        self,
        view: OptimizerView,
        norms: torch.Tensor,
        stepped: torch.Tensor | None,
        at: _Step,
        *,
        segmented: bool = True,
    ) -> None:
        """Pass the alarms the ``norms`` of step ``at``.

        They are per layer then global if ``segmented``, else per parameter. ``stepped`` holds
        the rows some gradient reached.
        """
        clip = at.clip  # the largest global norm the optimizer applies (by value: a bound)
        bound = None
        if clip is not None and clip.algorithm == "norm":
            bound = clip.bound
        elif clip is not None:
            bound = clip.bound * view.scale
        self.training_alarms.update(
            norms,
            view.row_ids,
            step=at.number,
            amp=at.amp,
            order=at.order,
            weights=partial(self._norms.weight_norms, view),
            stepped=stepped,
            clip=bound,
            segments=None if segmented else view.segments,
        )


def quiet_read(view: OptimizerView, triton: bool) -> Read:
    """Return the read of ``view``'s gradient norms by ``AlarmRules.quiet_read``.

    One that cannot be made is said once and :func:`foreach_norms` reads instead.

    Args:
        view: the optimizer's view.
        triton: the ``"triton"`` read; else the ``"grouped"`` one.
    """
    if triton:
        try:
            return _pointer_norms(view)
        except ValueError as error:  # no Triton, no CUDA, or a layout it does not read
            why = str(error)
        except Exception as error:  # its tables not made (pinned memory, say)
            why = f"its tables could not be built ({type(error).__name__}: {error})"
    else:
        try:
            return GroupedNorms(view.params)
        except Exception as error:  # its index not made
            why = f"it could not be made ({type(error).__name__}: {error})"
    _read_fallback(triton, why, 4)
    return foreach_norms


def foreach_norms(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Return each gradient's L2 norm, stacked, by one ``torch._foreach_norm`` (the last resort)."""
    return torch.stack(foreach_norm(list(grads)))


def _pointer_norms(view: OptimizerView) -> Read:
    """Return the pointer-table read of ``view``'s gradients.

    Raises:
        ValueError: Triton is missing, the gradients are not on CUDA, or their layout is one it
            does not read; the message says which.
    """
    why = pointer_norms.available()
    if why is None and view.params[0].device.type != "cuda":
        why = f"the gradients are on {view.params[0].device.type}, not CUDA"
    if why is not None:
        raise ValueError(why)
    try:
        return pointer_norms.PointerNorms(view.params)
    except ValueError as error:  # a layout it does not read
        raise ValueError(f"it reads {error}") from error


def _read_fallback(triton: bool, why: str, stacklevel: int = 3) -> None:
    """Warn once, for one optimizer, why the quiet step reads with ``_foreach_norm``.

    ``triton`` tells whether the read that failed was ``"triton"`` or ``"grouped"``.
    """
    read = "triton" if triton else "grouped"
    warnings.warn(
        f"AlarmRules(quiet_read={read!r}): {why}; quiet steps read the gradients' norms with "
        "torch._foreach_norm instead",
        LightningHooksWarning,
        stacklevel=stacklevel,
    )
