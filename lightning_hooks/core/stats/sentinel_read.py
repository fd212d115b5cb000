"""The gradient norms the alarms read at an optimizer step, quiet or sampled."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from functools import partial

import torch

from lightning_hooks.core.alarms import GradientAlarms
from lightning_hooks.core.ops import pointer_norms
from lightning_hooks.core.ops.grouped_norms import GroupedNorms, plain_grads
from lightning_hooks.core.stats.optimizer_view import OptimizerView, ViewStats
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["SentinelRead"]

_Read = Callable[[Sequence[torch.Tensor]], torch.Tensor]


class SentinelRead:
    """Hands :class:`GradientAlarms` their norms at each step their cadence runs them.

    Args:
        alarms: the alarms, or ``None`` (off).
        stats: the tracker's gradient statistics (the weight norms an alarm's diagnosis reads).
        order: the layer rows in the order their output-gradient hooks fired, emptied per step.
        clip: ``(gradient_clip_val, gradient_clip_algorithm)``, or ``None``.
    """

    def __init__(
        self,
        alarms: GradientAlarms | None,
        stats: ViewStats,
        order: list[int],
        clip: tuple[float, str] | None,
    ) -> None:
        self.alarms, self._stats, self._order, self._clip = alarms, stats, order, clip
        self._sharded = stats.shards is not None  # FSDP2: the general path makes norms whole
        self._triton = alarms is not None and alarms.rules.quiet_read == "triton"
        self._reads: dict[int, tuple[weakref.ref[OptimizerView], _Read]] = {}
        """The read of each live view's gradient norms, by the view's ``id``."""

    def due(self, step: int) -> GradientAlarms | None:
        """The alarms, when their cadence runs them at ``step``."""
        alarms = self.alarms
        return alarms if alarms is not None and step % alarms.rules.every_n_steps == 0 else None

    def quiet(self, view: OptimizerView, sampled: bool, amp: bool, step: int) -> bool:
        """A quiet step's read of dense gradients' norms, posted to the alarms (``True``: done).
        A sampled step only prepares the read and returns ``False``: its statistics serve."""
        if self.alarms is None or self._sharded:
            return False
        if sampled:  # the host copy and the read made here, not on a quiet step
            self.alarms.reserve(len(view.params))
            self._read(view)
            return False
        grads = plain_grads(view.params)
        if grads is None:  # a missing or sparse gradient: the general path
            return False
        try:
            norms = self._read(view)(grads)
        except Exception as error:  # a gradient set by hand, unlike its parameter; a Triton
            # that cannot launch the kernels: said once, then the multi-tensor read
            self._reads[id(view)] = (weakref.ref(view), _foreach)
            failed = "its kernels failed" if self._triton else "its stacks failed"
            _fallback(self._triton, f"{failed} ({type(error).__name__}: {error})")
            norms = _foreach(grads)
        self.post(view, norms, None, amp, step, segmented=False)
        return True

    def _read(self, view: OptimizerView) -> _Read:
        """The read of ``view``'s gradient norms, chosen once by ``AlarmRules.quiet_read``; one
        that cannot be made is said once and ``torch._foreach_norm`` reads instead."""
        kept = self._reads.get(id(view))
        if kept is not None and kept[0]() is view:
            return kept[1]
        read: _Read = _foreach
        try:
            read = _pointer_norms(view) if self._triton else GroupedNorms(view.params)
        except _RefusedError as error:
            _fallback(self._triton, str(error))
        except Exception as error:  # its index or tables not made (pinned memory, say)
            failed = "its tables could not be built" if self._triton else "it could not be made"
            _fallback(self._triton, f"{failed} ({type(error).__name__}: {error})")
        # the views of an epoch that ended are gone, and their reads with them
        self._reads = {k: kept for k, kept in self._reads.items() if kept[0]() is not None}
        self._reads[id(view)] = (weakref.ref(view), read)
        return read

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


def _foreach(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each gradient's L2 norm by one ``torch._foreach_norm`` (the read of last resort)."""
    return torch.stack(torch._foreach_norm(list(grads)))


class _RefusedError(Exception):
    """Why the pointer-table read cannot read these gradients."""


def _pointer_norms(view: OptimizerView) -> _Read:
    """The pointer-table read of ``view``'s gradients; :class:`_RefusedError` where it cannot be."""
    why = pointer_norms.available()
    if why is None and view.params[0].device.type != "cuda":
        why = f"the gradients are on {view.params[0].device.type}, not CUDA"
    if why is not None:
        raise _RefusedError(why)
    try:
        return pointer_norms.PointerNorms(view.params)
    except ValueError as error:  # a layout it does not read
        raise _RefusedError(f"it reads {error}") from error


def _fallback(triton: bool, why: str) -> None:
    """Say once, for one optimizer, why the quiet step reads with ``_foreach_norm``."""
    read = "triton" if triton else "grouped"
    warnings.warn(
        f"AlarmRules(quiet_read={read!r}): {why}; quiet steps read the gradients' norms with "
        "torch._foreach_norm instead",
        LightningHooksWarning,
        stacklevel=3,
    )
