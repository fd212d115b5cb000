"""The loss rules: *loss_spike* and *diverging*, their state and their report.

The device's only work is one copy of the loss into host memory (posted without blocking); the
rules run on the host, in ``float32``, when the copy is read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from lightning_hooks.core.alarms.messages import GradientAlarm, diverging_fires, loss_alarms
from lightning_hooks.core.alarms.rules import (
    _L_BEST,
    _L_DEV,
    _L_DIVERGING,
    _L_FIRST,
    _L_MEAN,
    _L_SCALE,
    _L_SPIKE,
    _L_VALUE,
    _LEARNT_NOISE,
    AlarmRules,
)
from lightning_hooks.core.alarms.scale import RunningScale, as_array, f32, lerp32
from lightning_hooks.core.transport.readback import HostMailbox

__all__ = ["LossRules"]

_F = np.float32


class _Constants(NamedTuple):
    """*diverging*'s constants, each rounded to ``float32`` once."""

    mean: float  # the running mean's weight
    bar: float  # diverge_ratio - 1
    early: float  # diverge_overshoot - 1
    learnt: float  # the share of what was learnt that the noise bar gives up
    noise: float
    giveback: float

    @classmethod
    def of(cls, rules: AlarmRules) -> _Constants:
        ratio = rules.diverge_ratio if rules.diverge_ratio is not None else math.nan
        return cls(
            *map(
                f32,
                (
                    2.0 / (rules.diverge_span + 1),
                    ratio - 1.0,
                    rules.diverge_overshoot - 1.0,
                    1.0 / _LEARNT_NOISE,
                    rules.diverge_noise,
                    rules.diverge_giveback,
                ),
            )
        )


class LossRules:
    """*loss_spike* and *diverging* on one training loss per step (a device scalar, copied to
    the host without blocking), evaluated on the host when the copy is read.

    The report's last four entries are *diverging*'s state (the loss's running mean, its mean
    absolute deviation, the best running mean and the first loss), updated in place.

    Args:
        rules: the rules and thresholds.
        device: where the losses live.
    """

    def __init__(self, rules: AlarmRules, device: torch.device) -> None:
        self.rules = rules
        self.scale = RunningScale(1, rules)
        self.report = np.zeros(_L_FIRST + 1, dtype=np.float32)
        self.report[_L_SCALE] = math.nan
        self.state = self.report[_L_MEAN:]
        self.seen = 0
        """Finite losses in the state."""
        self.adaptive = False
        """The optimizer keeps a second moment: its first ``diverge_early`` losses are held to
        the ``diverge_overshoot`` bar (:meth:`GradientAlarms.set_adaptive`)."""
        self._box = HostMailbox((1,), device)
        self._k = _Constants.of(rules)

    def update(self, loss: torch.Tensor, step: int) -> None:
        """Post ``loss`` (a copy, no sync); :meth:`read` evaluates it."""
        # float32 on the device first: a non-blocking copy to the host does not convert
        value = loss if loss.dtype == torch.float32 else loss.float()
        self._box.post(value, step)  # under no_grad: the copy records no graph

    def read(self, wait: bool) -> tuple[int, list[GradientAlarm]] | None:
        """Evaluate the posted loss once its copy is read: its step and alarms when a rule
        fired, else ``None``."""
        got = self._box.read(wait)
        if got is None:
            return None
        value, step = got
        report = self.evaluate(_F(value.reshape(-1)[0]))
        if not (report[_L_SPIKE] > 0 or diverging_fires(report, self.rules)):
            return None
        return step, loss_alarms(step, report.copy(), self.rules)

    def evaluate(self, x: np.float32) -> np.ndarray:
        """Apply the rules to the loss ``x``: the report, the state updated."""
        if self.rules.loss_factor is not None:
            with np.errstate(all="ignore"):
                self._spike(x)
        if self.rules.diverge_ratio is None:
            pass
        elif self.seen == 0:
            with np.errstate(all="ignore"):
                self._diverge_start(x)
        else:
            self._diverge_step(float(x))
        self.report[_L_VALUE] = x
        self.seen += math.isfinite(x)
        return self.report

    def _diverge_start(self, x: np.float32) -> None:
        """The first finite loss starts the state (running mean, best and first loss)."""
        if np.isfinite(x):
            self.state[:] = x
        self.report[_L_DEV] = 0.0
        self.report[_L_DIVERGING] = _F(-1.0) + x * _F(0.0)  # quiet, or NaN if not finite

    def _diverge_step(self, x: float) -> None:
        """*diverging*'s state updated in place and its margin (``>= 0`` or NaN: it fires):
        ``min(rise - noise_bar - (ratio - 1) |best|, rise - giveback * learnt)``.

        In ``float32`` arithmetic, done as Python floats each rounded to ``float32`` (exactly
        the same values: a double holds a ``float32`` operation's exact result, or rounds it
        innocuously): a scalar numpy operation costs ten times as much."""
        rules, r, k = self.rules, self.report, self._k
        mean, dev, best, first = self.state.tolist()
        # a non-finite loss moves nothing (its deviation counts as 0) and fires through margin
        delta = f32(x - mean)
        delta = delta if math.isfinite(delta) else 0.0
        mean = f32(mean + f32(k.mean * delta))
        best = min(best, mean)  # both finite
        rise, learnt = f32(mean - best), f32(first - best)  # learnt >= 0: best never rises
        # the first losses are held to the overshoot bar
        early = self.adaptive and self.seen < rules.diverge_early
        ratio = f32(rise - f32((k.early if early else k.bar) * abs(best)))
        if self.seen >= rules.min_history:
            # the noise bar is armed once it has ``min_history`` losses, as the spike rules
            # are: the deviation of the first one or two is a blow-up's own first steps
            noise = max(f32(dev - f32(k.learnt * learnt)), 0.0)
            ratio = f32(ratio - f32(k.noise * noise))
        giveback = f32(rise - f32(k.giveback * learnt))
        r[_L_DIVERGING] = min(ratio, giveback) + x * 0.0  # NaN when the loss is not finite
        # the deviation after the check: a blow-up's own step does not raise its bar
        weight = max(2.0 / (2 * rules.diverge_span + 1), 1.0 / self.seen)
        r[_L_MEAN], r[_L_BEST] = mean, best
        r[_L_DEV] = lerp32(dev, abs(delta), weight)

    def _spike(self, x: np.float32) -> None:
        """*loss_spike*'s flag and running scale into the report (the scale updated)."""
        assert self.rules.loss_factor is not None
        log_loss = np.log(np.array([x], dtype=np.float32))
        ceiling, _ = self.scale.threshold(self.rules.loss_factor)
        positive = np.abs(log_loss) < math.inf
        self.report[_L_SPIKE] = float((positive & (log_loss > ceiling))[0])
        self.report[_L_SCALE] = np.exp(self.scale.mean[0])
        self.scale.update(log_loss, positive, ceiling)

    def state_dict(self) -> dict[str, Any]:
        """The running scale, *diverging*'s state and the finite losses seen, on the host."""
        return {
            "loss_scale": torch.from_numpy(self.scale.state.copy()),
            "diverging": torch.from_numpy(self.state.copy()),
            "loss_seen": self.seen,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; an older state's *diverging* starts again."""
        self.scale.load(state["loss_scale"])
        if "diverging" in state:
            self.state[...] = as_array(state["diverging"])
            self.seen = int(state["loss_seen"])
