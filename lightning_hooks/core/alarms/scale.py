"""The running scale a spike is measured against: per row, an EMA of the log and of its spread."""

from __future__ import annotations

import math

import torch

from lightning_hooks.core.alarms.rules import AlarmRules

__all__ = ["RunningScale"]


class RunningScale:
    """Per row: EMA of ``log x`` and of its variance, and the count of finite steps seen.

    Written for few kernels: views of one state tensor made once, in-place updates.
    """

    def __init__(self, rows: int, rules: AlarmRules, device: torch.device) -> None:
        self.state = torch.zeros(3, rows, device=device)  # mean, variance, count
        self.mean, self.var, self.count = self.state.unbind(0)
        self.alpha = 2.0 / (rules.window + 1)
        self.armed_at = float(rules.min_history)
        self.sigmas = rules.spike_sigmas
        self._inf = torch.full((rows,), math.inf, device=device)

    def threshold(self, factor: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``log`` of the spike threshold per row (``inf`` until armed), and whether armed."""
        (ceiling,), armed = self.thresholds(factor)
        return ceiling, armed

    def thresholds(self, *factors: float) -> tuple[list[torch.Tensor], torch.Tensor]:
        """:meth:`threshold` for each of ``factors``, the spread read once (fewer kernels, the
        same values), and whether armed."""
        armed = torch.ge(self.count, self.armed_at)
        spread = self.var.sqrt().mul_(self.sigmas)
        ceilings = [
            torch.where(armed, spread.clamp_min(math.log(f)).add_(self.mean), self._inf)
            for f in factors
        ]
        return ceilings, armed

    def update(self, log_x: torch.Tensor, keep: torch.Tensor, ceiling: torch.Tensor) -> None:
        """Fold ``log_x`` into the rows where ``keep``. Above ``ceiling`` (a spike) only the
        mean moves, towards the ceiling: a lasting change of level is learnt in a few dozen
        steps, while the spread, which would otherwise grow with each spike, stays."""
        self.count.add_(keep)
        weight = self.count.clamp_min(1.0).reciprocal_().clamp_min_(self.alpha).mul_(keep)
        delta = torch.where(keep, torch.minimum(log_x, ceiling), self.mean).sub_(self.mean)
        spread = torch.mul(weight, torch.le(log_x, ceiling))
        self.mean.addcmul_(weight, delta)
        self.var.addcmul_(spread, delta.square()).mul_(torch.rsub(spread, 1.0))
