"""What the gradient alarms read from one optimizer's step: on a quiet step, one multi-tensor
norm of the parameters' gradients copied to the host; on a sampled step, the norms its
statistics computed."""

from __future__ import annotations

import warnings
from functools import partial
from typing import Literal

import torch

from lightning_hooks.core.alarms import GradientAlarms
from lightning_hooks.core.kernels import pointer_norms
from lightning_hooks.core.kernels.grad_stats import ParamLayout
from lightning_hooks.core.kernels.grouped_norms import GroupedNorms
from lightning_hooks.core.stats.optimizer_view import OptimizerView
from lightning_hooks.core.stats.view_stats import ViewStats
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["SentinelRead"]


class SentinelRead:
    """Hands :class:`GradientAlarms` their norms at each step their cadence runs them.

    Args:
        alarms: the alarms, or ``None`` (off).
        stats: the tracker's gradient statistics (the weight norms an alarm's diagnosis reads).
        order: the layer rows in the order their output-gradient hooks fired, emptied per step.
        clip: ``(gradient_clip_val, gradient_clip_algorithm)``, or ``None``.
        sharded: FSDP2: a quiet step's norms are made whole on the device, by the general path.
    """

    def __init__(
        self,
        alarms: GradientAlarms | None,
        stats: ViewStats,
        order: list[int],
        clip: tuple[float, str] | None,
        sharded: bool,
    ) -> None:
        self.alarms, self._stats, self._order = alarms, stats, order
        self._clip, self._sharded = clip, sharded

    def due(self, step: int) -> GradientAlarms | None:
        """The alarms, when their cadence runs them at ``step``."""
        alarms = self.alarms
        return alarms if alarms is not None and step % alarms.rules.every_n_steps == 0 else None

    def quiet(self, view: OptimizerView, sampled: bool, amp: bool, step: int) -> bool:
        """A quiet step's read, when every gradient is a plain dense tensor (``True``: done):
        one multi-tensor norm of the parameters' gradients, posted to the host, where it is
        folded into the layers' rows and the rules run. A sampled step makes that host copy
        ready and returns ``False``: its statistics give the alarms their norms."""
        if self.alarms is None or self._sharded:
            return False
        if sampled:  # the host copy and the grouped read made here, not on a quiet step
            self.alarms.reserve(len(view.params))
            if view.grouped is None and self.alarms.rules.quiet_read == "grouped":
                view.grouped = _grouped(view)
            return False
        grads = ParamLayout.plain_grads(view.params)
        if grads is None:  # a missing or sparse gradient: the general path
            return False
        self.post(view, self._norms(view, grads), None, amp, step, segmented=False)
        return True

    def _norms(self, view: OptimizerView, grads: list[torch.Tensor]) -> torch.Tensor:
        """Each gradient's L2 norm, read as ``AlarmRules.quiet_read`` says: small gradients of one
        shape stacked (``"grouped"``, :class:`GroupedNorms`), one ``_foreach_norm``, or the
        pointer-table kernels where they can read these gradients (``"triton"``)."""
        read = self.alarms.rules.quiet_read if self.alarms else "foreach"
        if read == "grouped":
            if view.grouped is None:
                view.grouped = _grouped(view)
            if view.grouped:
                try:
                    return view.grouped(grads)
                except Exception as error:  # a gradient set by hand, unlike its parameter
                    why = f"its stacks failed ({type(error).__name__}: {error})"
                    view.grouped = _fallback("grouped", why)
        if view.pointers is None and read == "triton":
            view.pointers = self._pointer_norms(view)
        if view.pointers:  # a PointerNorms (False: it cannot read them)
            try:
                norms = view.pointers(grads)
            except Exception as error:  # a Triton that cannot build or launch the kernels
                why = f"its kernels failed ({type(error).__name__}: {error})"
                view.pointers = _fallback("triton", why)
            else:
                if norms is not None:  # None: a gradient set by hand that is not contiguous
                    return norms
        return torch.stack(torch._foreach_norm(grads))

    @staticmethod
    def _pointer_norms(view: OptimizerView) -> pointer_norms.PointerNorms | Literal[False]:
        """The pointer-table read of ``view``'s gradients, or ``False`` with one message."""
        why = pointer_norms.available()
        if why is None and view.params[0].device.type != "cuda":
            why = f"the gradients are on {view.params[0].device.type}, not CUDA"
        if why is None:
            try:
                return pointer_norms.PointerNorms(view.params)
            except ValueError as error:  # a layout it does not read
                why = f"it reads {error}"
            except Exception as error:  # its tables could not be built (pinned memory, say)
                why = f"its tables could not be built ({type(error).__name__}: {error})"
        return _fallback("triton", why)

    def post(
        self,
        view: OptimizerView,
        norms: torch.Tensor,
        stepped: torch.Tensor | None,
        amp: bool,
        step: int,
        *,
        segmented: bool = True,
    ) -> None:
        """Hand ``norms`` to the alarms: ``[rows]`` per layer, then global (``segmented``), or
        ``[parameters]``, folded on the host; ``stepped``: the rows some gradient reached."""
        assert self.alarms is not None
        self.alarms.update(
            norms,
            view.row_ids,
            step=step,
            amp=amp,
            order=self._order,
            weights=partial(self._stats.weight_norms, view),
            stepped=stepped,
            clip=view.clip_norm(self._clip),
            segments=None if segmented else view.segments,
        )
        self._order.clear()


def _grouped(view: OptimizerView) -> GroupedNorms | Literal[False]:
    """The grouped read of ``view``'s gradients, or ``False`` with one message if it cannot be
    made (its index copied to the device, say)."""
    try:
        return GroupedNorms(view.params)
    except Exception as error:
        return _fallback("grouped", f"it could not be made ({type(error).__name__}: {error})")


def _fallback(read: str, why: str) -> Literal[False]:
    """Say once, for one optimizer, why the quiet step reads with ``_foreach_norm``."""
    warnings.warn(
        f"AlarmRules(quiet_read={read!r}): {why}; quiet steps read the gradients' norms with "
        "torch._foreach_norm instead",
        LightningHooksWarning,
        stacklevel=3,
    )
    return False
