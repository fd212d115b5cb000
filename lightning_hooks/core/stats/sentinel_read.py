"""What the gradient alarms read from one optimizer's step: on a quiet step, one multi-tensor
norm of the parameters' gradients copied to the host; on a sampled step, the norms its
statistics computed."""

from __future__ import annotations

from functools import partial

import torch

from lightning_hooks.core.alarms import GradientAlarms
from lightning_hooks.core.kernels.grad_stats import ParamLayout
from lightning_hooks.core.stats.optimizer_view import OptimizerView
from lightning_hooks.core.stats.view_stats import ViewStats

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
        if sampled:
            self.alarms.reserve(len(view.params))
            return False
        grads = ParamLayout.plain_grads(view.params)
        if grads is None:  # a missing or sparse gradient: the general path
            return False
        self.post(view, torch.stack(torch._foreach_norm(grads)), None, amp, step, segmented=False)
        return True

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
