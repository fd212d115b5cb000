"""The running scale a spike is measured against: per row, an EMA of the log and of its spread.

Host arithmetic (numpy, float32, as the device rules computed it before issue 36): the rules
read values already copied to the host, so a quiet step launches no kernel for them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from lightning_hooks.core.alarms.rules import AlarmRules

__all__ = ["RunningScale", "as_array", "lerp"]

_F = np.float32


def lerp(start: np.float32, end: np.float32, weight: float) -> np.float32:
    """``torch.lerp``'s formula, in ``float32``: exact at both ends for any weight."""
    w = _F(weight)
    out: np.float32 = start + w * (end - start) if w < 0.5 else end - (end - start) * (_F(1) - w)
    return out


def as_array(value: Any) -> np.ndarray:
    """A saved state entry (a tensor, or an array) as a host array."""
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


class RunningScale:
    """Per row: EMA of ``log x`` and of its variance, and the count of finite steps seen.

    Views of one ``float32`` state array, updated in place.
    """

    def __init__(self, rows: int, rules: AlarmRules) -> None:
        self.state = np.zeros((3, rows), dtype=np.float32)  # mean, variance, count
        self.mean, self.var, self.count = self.state
        self.alpha = np.float32(2.0 / (rules.window + 1))
        self.armed_at = float(rules.min_history)
        self.sigmas = np.float32(rules.spike_sigmas)
        self._logs: dict[tuple[float, ...], np.ndarray] = {}  # ``[[log f], ...]`` per factors

    def threshold(self, factor: float) -> tuple[np.ndarray, np.ndarray]:
        """``log`` of the spike threshold per row (``inf`` until armed), and whether armed."""
        (ceiling,), armed = self.thresholds(factor)
        return ceiling, armed

    def thresholds(self, *factors: float) -> tuple[list[np.ndarray], np.ndarray]:
        """:meth:`threshold` for each of ``factors``, the spread read once, and whether armed
        (every factor's row in one array: a handful of numpy calls, whatever their number)."""
        logs = self._logs.get(factors)
        if logs is None:
            logs = self._logs[factors] = np.array([[math.log(f)] for f in factors], np.float32)
        armed = self.count >= self.armed_at
        ceilings = np.maximum(np.sqrt(self.var) * self.sigmas, logs)  # [factors, rows]
        ceilings += self.mean
        ceilings[:, ~armed] = np.inf
        return list(ceilings), armed

    def update(self, log_x: np.ndarray, keep: np.ndarray, ceiling: np.ndarray) -> None:
        """Fold ``log_x`` into the rows where ``keep``. Above ``ceiling`` (a spike) only the
        mean moves, towards the ceiling: a lasting change of level is learnt in a few dozen
        steps, while the spread, which would otherwise grow with each spike, stays."""
        self.count += keep
        weight = np.maximum(np.reciprocal(np.maximum(self.count, np.float32(1.0))), self.alpha)
        weight *= keep
        delta = np.where(keep, np.minimum(log_x, ceiling), self.mean) - self.mean
        spread = weight * (log_x <= ceiling)
        self.mean += weight * delta
        self.var += spread * np.square(delta)
        self.var *= np.float32(1.0) - spread

    def update_all(self, log_x: np.ndarray) -> None:
        """:meth:`update` where every row is kept and none is above its ceiling (a step on
        which no rule fired): the same arithmetic, the same state, six numpy calls fewer."""
        self.count += np.float32(1.0)
        weight = np.maximum(np.reciprocal(np.maximum(self.count, np.float32(1.0))), self.alpha)
        delta = log_x - self.mean
        self.mean += weight * delta
        self.var += weight * np.square(delta)
        self.var *= np.float32(1.0) - weight
