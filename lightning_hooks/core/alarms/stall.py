"""The stall rule on the device: the optimizer's update per unit of learning rate against its
running level, on logging steps."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from lightning_hooks.core.alarms.messages import GradientAlarm, stall_alarm
from lightning_hooks.core.alarms.rules import (
    _S_BEST,
    _S_FLAG,
    _STALL_ALPHA,
    _STALL_LR_FLOOR,
    AlarmRules,
)
from lightning_hooks.core.transport.readback import HostMailbox

__all__ = ["StallRule"]


class StallRule:
    """*stall*'s state (its flag, the log of the update per unit of learning rate, its running
    level before this logging step, the loss's progress since the last one, then the level after
    this step and the loss's best) and its report to the host.

    Args:
        rules: the rules and thresholds.
        device: where the state lives.
    """

    def __init__(self, rules: AlarmRules, device: torch.device) -> None:
        self.rules = rules
        self.state = torch.full((_S_BEST + 1,), torch.nan, device=device)
        self._box = HostMailbox((_S_BEST + 1,), device)
        self.peak_lr = 0.0
        """The largest learning rate seen so far."""

    def due(self, lr: float) -> bool:
        """Whether the rule is evaluated at ``lr`` (on, and ``lr`` at least 1% of its peak so
        far, the peak updated: a schedule decaying it to zero moves the weights less than
        float32 resolves)."""
        if self.rules.stall_factor is None or not lr > 0.0:
            return False
        self.peak_lr = max(self.peak_lr, float(lr))
        return not lr < _STALL_LR_FLOOR * self.peak_lr

    def update(
        self, update: torch.Tensor, lr: float, step: int, loss: torch.Tensor | None = None
    ) -> None:
        """Fold ``update / lr`` into the level and post the verdict (a few kernels, no sync).
        ``loss``: *diverging*'s state ``[mean, dev, best, first]``; the rule fires only when
        its best improved by at most ``stall_progress`` of what was learnt since the last
        call (``None``: the update alone decides)."""
        assert self.rules.stall_factor is not None
        flag, value, before, progress, level, best = self.state.unbind(0)
        torch.div(update.detach().reshape(()).float(), lr, out=value).log_()
        before.copy_(level)
        low = torch.sub(level, math.log(self.rules.stall_factor))
        finite = torch.lt(value.abs(), math.inf)
        # False while the level is NaN (the first logging step), and on a zero update (-inf):
        # a weight that does not move at all is a dead unit or a frozen tensor, not this rule's
        torch.lt(value, low, out=flag).logical_and_(finite)
        if loss is not None:  # a run whose loss still improves is not stalled
            now, first = loss[2], loss[3]
            # progress since the last call; at the first call with a loss, since the first loss
            torch.where(best.isnan(), first, best, out=progress).sub_(now)
            progress.div_(torch.sub(first, now))  # 0 / 0 (nothing learnt yet): NaN, quiet
            flag.logical_and_(torch.le(progress, self.rules.stall_progress))
            best.copy_(now)
        # a collapse folds in clamped (as the spike rule's scale), so it keeps firing a while
        target = torch.where(finite, torch.maximum(value, low), level)
        start = torch.logical_and(level.isnan(), finite)
        level.lerp_(target, _STALL_ALPHA).copy_(torch.where(start, value, level))
        self._box.post(self.state, step)

    def read(self, wait: bool) -> GradientAlarm | None:
        """The alarm of the posted verdict once read, when the rule fired; else ``None``."""
        got = self._box.read(wait)
        if got is None or not got[0][_S_FLAG] > 0:
            return None
        report, step = got
        return stall_alarm(report, step, self.rules)

    def state_dict(self) -> dict[str, Any]:
        """The state and the peak learning rate, on the host."""
        return {"stall": self.state.cpu(), "peak_lr": self.peak_lr}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; an older state's level starts again."""
        if "stall" in state and state["stall"].shape == self.state.shape:
            self.state.copy_(state["stall"])
            self.peak_lr = float(state["peak_lr"])
