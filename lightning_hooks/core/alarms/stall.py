"""The rule *stall* on the optimizer's update at logging steps, and its alarm.

The rule compares the update per unit of learning rate against its running level, while the
loss has stopped learning. The device only copies the update to host memory without blocking;
the rule runs on the host, in ``float32``, when the copy is read.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import astuple, dataclass
from typing import Any

import numpy as np
import torch

from lightning_hooks.core.alarms.gradients import as_array
from lightning_hooks.core.alarms.loss import LossProgress
from lightning_hooks.core.alarms.messages import TrainingAlarm
from lightning_hooks.core.alarms.rules import AlarmRules
from lightning_hooks.core.host_copy import HostCopy

__all__ = ["StallRule", "StallState"]

_F = np.float32
_STALL_LR_FLOOR = 0.01  # below this share of its peak, the LR is being decayed away: no stall
_STALL_ALPHA = 0.5  # the stall's level: an EMA over the last few logging steps
_PACK = struct.Struct("f")
_NAN = _F(math.nan)


@dataclass
class StallState:
    """*stall*'s report on the last logging step and what it carries to the next.

    In ``float32`` as the rule computes it; a checkpoint holds it as one array (:meth:`array`).
    """

    flag: bool = False
    """Whether the rule fired at the last logging step."""
    value: np.float32 = _NAN
    """The log of the update per unit of learning rate."""
    before: np.float32 = _NAN
    """Its running level before this logging step (a log)."""
    progress: np.float32 = _NAN
    """The loss's progress since the last logging step, a share of what it had learnt."""
    level: np.float32 = _NAN
    """The running level after this logging step (a log)."""
    best: np.float32 = _NAN
    """The loss's best at this logging step."""

    def array(self) -> np.ndarray:
        """Return the state as a checkpoint holds it.

        Returns:
            ``[flag, value, before, progress, level, best]``, in ``float32``.
        """
        return np.array(astuple(self), dtype=np.float32)

    @classmethod
    def of(cls, array: np.ndarray) -> StallState:
        """Return the state a checkpoint's :meth:`array` holds.

        Args:
            array: the array :meth:`array` made.

        Returns:
            The state.
        """
        flag, *values = (_F(x) for x in array)
        return cls(bool(flag), *values)


def _f32(value: float) -> float:
    """Round ``value`` to the nearest ``float32`` (overflow to a signed ``inf``), as a Python float.

    Rounding after each operation gives numpy ``float32`` scalars' bits, cheaper.
    """
    try:
        rounded: float = _PACK.unpack(_PACK.pack(value))[0]
    except OverflowError:  # a Python whose pack refuses what a cast rounds to inf
        return math.copysign(math.inf, value)
    return rounded


def _lerp32(start: float, end: float, weight: float) -> float:
    """Compute ``torch.lerp``'s formula (exact at both ends for any weight) on Python floats.

    Rounded to ``float32`` after each operation.
    """
    w = _f32(weight)
    d = _f32(end - start)
    return _f32(start + _f32(w * d)) if w < 0.5 else _f32(end - _f32(d * _f32(1.0 - w)))


class StallRule:
    """*stall*'s state and the update's copy to the host.

    Args:
        rules: the alarm rules (``stall_factor``, ``stall_progress``).
        device: the device the update lives on, copied from.
    """

    def __init__(self, rules: AlarmRules, device: torch.device) -> None:
        self.rules = rules
        self.state = StallState()
        self._host_copy = HostCopy((1,), device)
        self.peak_lr = 0.0
        """The largest learning rate seen so far."""

    def due(self, lr: float) -> bool:
        """Return whether the rule is on and ``lr`` is at least 1% of its peak so far.

        The peak is updated. A schedule decaying the learning rate to zero moves the weights
        below float32's resolution.

        Args:
            lr: the learning rate of this step.

        Returns:
            Whether the rule should evaluate this step's update.
        """
        if self.rules.stall_factor is None or not lr > 0.0:
            return False
        self.peak_lr = max(self.peak_lr, float(lr))
        return not lr < _STALL_LR_FLOOR * self.peak_lr

    def update(
        self, update: torch.Tensor, lr: float, step: int, loss: LossProgress | None = None
    ) -> None:
        """Post ``update`` for :meth:`read` (a copy, no sync).

        Args:
            update: the update per unit of learning rate, a device scalar.
            lr: the learning rate of this step.
            step: the optimizer step, quoted by the alarm.
            loss: how far the loss has come at this step (``None``: the update alone decides).
        """
        self._host_copy.post(update.detach().reshape(1).float(), (step, lr, loss))

    def read(self, wait: bool) -> TrainingAlarm | None:
        """Evaluate the posted update once its copy is read.

        Args:
            wait: block until the copy is read.

        Returns:
            The alarm if the rule fired, else ``None`` (also while the copy is not read).
        """
        got = self._host_copy.read(wait)
        if got is None:
            return None
        value, (step, lr, loss) = got
        with np.errstate(all="ignore"):
            self.evaluate(_F(value[0]), lr, loss)
        return _stall(self.state, step, self.rules) if self.state.flag else None

    def evaluate(self, update: np.float32, lr: float, loss: LossProgress | None) -> None:
        """Fold ``update / lr`` into the level and set the flag (the state updated).

        Args:
            update: the update read on the host.
            lr: the learning rate it was made with.
            loss: how far the loss has come (``None``: the update alone decides).
        """
        assert self.rules.stall_factor is not None
        s = self.state
        level = s.level
        value = np.log(update / _F(lr))
        s.value = value
        s.before = level
        low = level - _F(math.log(self.rules.stall_factor))
        finite = bool(abs(value) < math.inf)
        # False while the level is NaN (the first logging step), and on a zero update (-inf):
        # a weight that does not move at all is a dead unit or a frozen tensor, not this rule's
        flag = bool(value < low) and finite
        if loss is not None:  # a run whose loss still improves is not stalled
            now = _F(loss.best)
            first = _F(loss.first)
            # progress since the last call; at the first call with a loss, since the first loss
            since = first if np.isnan(s.best) else s.best
            s.progress = (since - now) / (first - now)  # 0 / 0: NaN, quiet
            flag = flag and bool(s.progress <= self.rules.stall_progress)
            s.best = now
        s.flag = flag
        # a collapse folds in clamped (as the spike rule's scale), so it keeps firing a while
        target = np.maximum(value, low) if finite else level
        start = bool(np.isnan(level)) and finite
        s.level = value if start else _F(_lerp32(float(level), float(target), _STALL_ALPHA))

    def state_dict(self) -> dict[str, Any]:
        """Return the state and the peak learning rate, for a checkpoint.

        Returns:
            ``{"stall": ..., "peak_lr": ...}``, on the host.
        """
        return {"stall": torch.from_numpy(self.state.array()), "peak_lr": self.peak_lr}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the level starts afresh if the saved one is of another size.

        Args:
            state: what :meth:`state_dict` returned, in the current format
                (:func:`~lightning_hooks.core.alarms.saved_state.upgrade`).
        """
        if tuple(state["stall"].shape) == self.state.array().shape:
            self.state = StallState.of(as_array(state["stall"]))
            self.peak_lr = float(state["peak_lr"])


def _stall(report: StallState, step: int, rules: AlarmRules) -> TrainingAlarm:
    """Write *stall*'s alarm from its report (the update per unit of LR and its level, as logs)."""
    value = math.exp(report.value)
    level = math.exp(report.before)
    text = (
        f"learning stalled at optimizer step {step}: updates per unit of learning rate "
        f"{level / value:.3g}x below their running level"
    )
    details = [
        f"the typical update per unit of learning rate (median |w_after - w_before| / lr) is "
        f"{value:.4g}, its running level {level:.4g} (stall_factor={rules.stall_factor}): the "
        "optimizer barely moves the weights while the learning rate says it should"
    ]
    if math.isfinite(report.progress) and rules.stall_progress < 1.0:
        details.append(
            f"the loss has stopped learning: its best improved by "
            f"{max(report.progress, 0.0):.1%} of what the run had learnt since the last "
            "logging step"
        )
    return TrainingAlarm("stall", "global", step, value, level, text, details=tuple(details))
