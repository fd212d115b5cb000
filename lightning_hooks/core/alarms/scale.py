"""The running scale a spike is measured against: per row, an EMA of the log and of its spread.

Host arithmetic (numpy, float32, as the device rules computed it before issue 36): the rules
read values already copied to the host, so a quiet step launches no kernel for them.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import torch

from lightning_hooks.core.alarms.rules import AlarmRules

__all__ = ["RunningScale", "as_array", "f32", "lerp", "lerp32"]

_F = np.float32
_LOG_MAX = _F(np.log(np.finfo(np.float32).max))  # the log of the largest float32 norm


def lerp(start: np.float32, end: np.float32, weight: float) -> np.float32:
    """``torch.lerp``'s formula, in ``float32``: exact at both ends for any weight."""
    w = _F(weight)
    out: np.float32 = start + w * (end - start) if w < 0.5 else end - (end - start) * (_F(1) - w)
    return out


_PACK = struct.Struct("f")


def f32(value: float) -> float:
    """``value`` rounded to the nearest ``float32`` (overflow to a signed ``inf``), as a Python
    float: Python-float arithmetic rounded so after each operation is ``float32`` arithmetic.

    Example:
        >>> f32(0.1) == float(np.float32(0.1)), f32(1e39), f32(-1e39)
        (True, inf, -inf)
    """
    try:
        rounded: float = _PACK.unpack(_PACK.pack(value))[0]
    except OverflowError:  # a Python whose pack refuses what a cast rounds to inf
        return math.copysign(math.inf, value)
    return rounded


def lerp32(start: float, end: float, weight: float) -> float:
    """:func:`lerp` on Python floats, rounded to ``float32`` after each operation."""
    w = f32(weight)
    d = f32(end - start)
    return f32(start + f32(w * d)) if w < 0.5 else f32(end - f32(d * f32(1.0 - w)))


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
        self._steady = False
        self._keep = np.float32(1.0) - self.alpha  # what the variance keeps of a steady step
        self._spread = np.zeros(rows, dtype=np.float32)  # work buffers of the quiet steps
        self._top = np.zeros(rows, dtype=np.float32)

    def threshold(self, factor: float) -> tuple[np.ndarray, np.ndarray]:
        """``log`` of the spike threshold per row (``inf`` until armed), and whether armed."""
        (ceiling,), armed, _ = self.thresholds(factor)
        return ceiling, armed

    def thresholds(self, *factors: float) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """:meth:`threshold` for each of ``factors``, the spread read once, whether armed, and
        each factor's band: the half-width of its ceiling above the mean in log,
        ``max(spike_sigmas * std, log(factor))`` (``inf`` until armed). Every factor's row is
        in one array: a handful of numpy calls, whatever their number."""
        logs = self._logs.get(factors)
        if logs is None:
            logs = self._logs[factors] = np.array([[math.log(f)] for f in factors], np.float32)
        armed = self.count >= self.armed_at
        bands = np.maximum(np.sqrt(self.var) * self.sigmas, logs)  # [factors, rows]
        bands[:, ~armed] = np.inf
        return list(bands + self.mean), armed, bands

    def load(self, state: Any) -> None:
        """Restore a saved :attr:`state` (a tensor, or an array)."""
        self.state[...] = as_array(state)
        self._steady = False

    def steady(self) -> bool:
        """Every row is armed and past its first ``1 / alpha`` steps, so that the EMA's weight
        is ``alpha`` everywhere: true from then on (counts only grow, until :meth:`load`)."""
        if not self._steady:
            count = self.count
            armed = bool((count >= self.armed_at).all())
            self._steady = armed and bool((np.reciprocal(np.maximum(count, 1)) <= self.alpha).all())
        return self._steady

    def quiet_ceiling(self, low: np.float32 | None, band: np.ndarray, first: np.float32) -> Any:
        """Where :meth:`steady`: the lowest of the factors' ceilings, ``mean + max(spike_sigmas
        * std, low)`` (``low``: the log of the lowest factor, ``None``: ``first``), with the
        first factor's band written into ``band``; ``_LOG_MAX`` where every factor is off."""
        spread = np.sqrt(self.var, out=self._spread)
        spread *= self.sigmas
        np.maximum(spread, first, out=band)
        bound = band if low is None else np.maximum(spread, low, out=spread)
        if bound is band and first == math.inf:  # no ceiling: only a non-finite norm stands out
            return _LOG_MAX
        return np.add(bound, self.mean, out=self._top)

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

    def update_steady(self, log_x: np.ndarray) -> None:
        """:meth:`update` where :meth:`steady`, every row kept and none above its ceiling (a
        step on which no rule fired): the same arithmetic, the same state, in half the numpy
        calls (the weight is ``alpha`` on every row)."""
        self.count += np.float32(1.0)
        delta = np.subtract(log_x, self.mean, out=self._spread)
        self.mean += np.multiply(delta, self.alpha, out=self._top)
        delta *= delta
        delta *= self.alpha
        self.var += delta
        self.var *= self._keep
