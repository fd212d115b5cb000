"""The stall rule: the optimizer's update per unit of learning rate against its running level,
on logging steps. The device copies the update to the host; the rule runs there."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lightning_hooks.core.alarms.messages import GradientAlarm, stall_alarm
from lightning_hooks.core.alarms.rules import (
    _S_BEFORE,
    _S_BEST,
    _S_FLAG,
    _S_LEVEL,
    _S_PROGRESS,
    _S_VALUE,
    _STALL_ALPHA,
    _STALL_LR_FLOOR,
    AlarmRules,
)
from lightning_hooks.core.alarms.scale import as_array, lerp
from lightning_hooks.core.transport.readback import HostMailbox

__all__ = ["StallRule"]

_F = np.float32


class StallRule:
    """*stall*'s state (its flag, the log of the update per unit of learning rate, its running
    level before this logging step, the loss's progress since the last one, then the level after
    this step and the loss's best) and the update's copy to the host.

    Args:
        rules: the rules and thresholds.
        device: where the update lives.
    """

    def __init__(self, rules: AlarmRules, device: torch.device) -> None:
        self.rules = rules
        self.state = np.full(_S_BEST + 1, np.nan, dtype=np.float32)
        self._box = HostMailbox((1,), device)
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
        self, update: torch.Tensor, lr: float, step: int, loss: np.ndarray | None = None
    ) -> None:
        """Post ``update`` (a device scalar: a copy, no sync) for :meth:`read`. ``loss``:
        *diverging*'s state ``[mean, dev, best, first]`` as of this step (copied); the rule fires
        only when its best improved by at most ``stall_progress`` of what was learnt since the
        last call (``None``: the update alone decides)."""
        snapshot = None if loss is None else loss.copy()
        self._box.post(update.detach().reshape(1).float(), (step, lr, snapshot))

    def read(self, wait: bool) -> GradientAlarm | None:
        """Evaluate the posted update once its copy is read: the alarm when the rule fired,
        else ``None``."""
        got = self._box.read(wait)
        if got is None:
            return None
        value, (step, lr, loss) = got
        with np.errstate(all="ignore"):
            self.evaluate(_F(value[0]), lr, loss)
        return stall_alarm(self.state.copy(), step, self.rules) if self.state[_S_FLAG] else None

    def evaluate(self, update: np.float32, lr: float, loss: np.ndarray | None) -> None:
        """Fold ``update / lr`` into the level and set the flag (the state updated)."""
        assert self.rules.stall_factor is not None
        s = self.state
        level = s[_S_LEVEL]
        value = np.log(update / _F(lr))
        s[_S_VALUE], s[_S_BEFORE] = value, level
        low = level - _F(math.log(self.rules.stall_factor))
        finite = bool(abs(value) < math.inf)
        # False while the level is NaN (the first logging step), and on a zero update (-inf):
        # a weight that does not move at all is a dead unit or a frozen tensor, not this rule's
        flag = bool(value < low) and finite
        if loss is not None:  # a run whose loss still improves is not stalled
            now, first = loss[2], loss[3]
            # progress since the last call; at the first call with a loss, since the first loss
            since = first if np.isnan(s[_S_BEST]) else s[_S_BEST]
            s[_S_PROGRESS] = (since - now) / (first - now)  # 0 / 0: NaN, quiet
            flag = flag and bool(s[_S_PROGRESS] <= self.rules.stall_progress)
            s[_S_BEST] = now
        s[_S_FLAG] = flag
        # a collapse folds in clamped (as the spike rule's scale), so it keeps firing a while
        target = np.maximum(value, low) if finite else level
        start = bool(np.isnan(level)) and finite
        s[_S_LEVEL] = value if start else lerp(level, target, _STALL_ALPHA)

    def state_dict(self) -> dict[str, Any]:
        """The state and the peak learning rate, on the host."""
        return {"stall": torch.from_numpy(self.state.copy()), "peak_lr": self.peak_lr}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; an older state's level starts again."""
        if "stall" in state and tuple(state["stall"].shape) == self.state.shape:
            self.state[...] = as_array(state["stall"])
            self.peak_lr = float(state["peak_lr"])
