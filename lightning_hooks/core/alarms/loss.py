"""*loss_spike* and *diverging* on the training loss at each step, *stall* on the optimizer's
update at logging steps, and their alarms. The device only copies the loss (or update) to host
memory without blocking; the rules run on the host, in ``float32``, when the copy is read."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lightning_hooks.core.alarms.gradients import RunningScale, as_array
from lightning_hooks.core.alarms.messages import GradientAlarm, ratio_text
from lightning_hooks.core.alarms.rules import AlarmRules
from lightning_hooks.core.transport import HostMailbox

__all__ = ["LossRules", "StallRule"]

_F = np.float32
_LEARNT_NOISE = 4.0  # diverging's noise bar shrinks by 1/4 of what the run has learnt
_STALL_LR_FLOOR = 0.01  # below this share of its peak, the LR is being decayed away: no stall
_STALL_ALPHA = 0.5  # the stall's level: an EMA over the last few logging steps
_PACK = struct.Struct("f")
# the loss report: loss_spike's flag, diverging's margin (it fires unless the margin is < 0: NaN
# for a non-finite loss), the loss, its running scale; then diverging's state: the loss's running
# mean, its mean absolute deviation, the best running mean, the first loss
_L_SPIKE, _L_DIVERGING, _L_VALUE, _L_SCALE, _L_MEAN, _L_DEV, _L_BEST, _L_FIRST = range(8)
# the stall report: its flag, the log of the update per unit of learning rate, its running level
# before this logging step, the loss's progress since the last one (a share of what it had
# learnt), then the state: the level after this step, the loss's best at this step
_S_FLAG, _S_VALUE, _S_BEFORE, _S_PROGRESS, _S_LEVEL, _S_BEST = range(6)


def _f32(value: float) -> float:
    """``value`` rounded to the nearest ``float32`` (overflow to a signed ``inf``), as a Python
    float: rounding after each operation gives numpy ``float32`` scalars' bits, cheaper."""
    try:
        rounded: float = _PACK.unpack(_PACK.pack(value))[0]
    except OverflowError:  # a Python whose pack refuses what a cast rounds to inf
        return math.copysign(math.inf, value)
    return rounded


def _lerp32(start: float, end: float, weight: float) -> float:
    """``torch.lerp``'s formula (exact at both ends for any weight) on Python floats, rounded
    to ``float32`` after each operation."""
    w = _f32(weight)
    d = _f32(end - start)
    return _f32(start + _f32(w * d)) if w < 0.5 else _f32(end - _f32(d * _f32(1.0 - w)))


class LossRules:
    """*loss_spike* and *diverging* on one training loss per step, evaluated on the host when
    its non-blocking copy is read; the report (``_L_*``) holds *diverging*'s state."""

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
        self.rise: list[float] = []
        """The current rise: its first step, losses so far, peak running mean; ``[]``: none."""
        self._box = HostMailbox((1,), device)
        ratio = rules.diverge_ratio if rules.diverge_ratio is not None else math.nan
        bars = (2.0 / (rules.diverge_span + 1), ratio - 1.0, rules.diverge_overshoot - 1.0)
        shares = (1.0 / _LEARNT_NOISE, rules.diverge_noise, rules.diverge_giveback)
        self._k = tuple(map(_f32, bars + shares))  # *diverging*'s, rounded to float32 once

    def update(self, loss: torch.Tensor, step: int) -> None:
        """Post ``loss`` (a copy, no sync); :meth:`read` evaluates it."""
        # float32 on the device first: a non-blocking copy to the host does not convert
        value = loss if loss.dtype == torch.float32 else loss.float()
        self._box.post(value, step)  # under no_grad: the copy records no graph

    def read(self, wait: bool) -> tuple[int, list[GradientAlarm]] | None:
        """Evaluate the posted loss once its copy is read: its step and alarms, if any."""
        got = self._box.read(wait)
        if got is None:
            return None
        value, step = got
        report = self.evaluate(_F(value.reshape(-1)[0]))
        diverging, ended = self._judge(report, step)
        alarms = [] if ended is None else [_transient(step, ended, report, self.rules)]
        if report[_L_SPIKE] > 0:
            alarms.append(_loss_spike(step, report, self.rules))
        if diverging:
            alarms.append(_diverging(step, report, self.rules))
        return (step, alarms) if alarms else None

    def _judge(self, report: np.ndarray, step: int) -> tuple[bool, list[float] | None]:
        """Whether *diverging* warns at ``step``, and the rise that ended as a transient, if any."""
        if self.rules.diverge_ratio is None:
            return False, None
        margin, rise = report[_L_DIVERGING], self.rise
        if margin < 0:  # quiet: a rise that never warned ends as a transient
            self.rise = []
            return False, (rise if rise and rise[1] > 0 else None)
        mean = float(report[_L_MEAN])
        rise = self.rise = rise or [float(step), 0.0, mean]
        rise[2] = max(rise[2], mean)
        lost = not mean < self.rules.diverge_lost * float(report[_L_FIRST])
        lost = lost or not math.isfinite(report[_L_VALUE])
        if rise[1] >= 0 and (lost or rise[1] + 1 >= self.rules.diverge_patience):
            rise[1] = -1.0  # warned: it no longer ends as a transient
        elif rise[1] >= 0:
            rise[1] += 1
        return rise[1] < 0, None

    def evaluate(self, x: np.float32) -> np.ndarray:
        """Apply the rules to the loss ``x``: the report, the state updated."""
        if self.rules.loss_factor is not None:
            with np.errstate(all="ignore"):
                self._spike(x)
        if self.rules.diverge_ratio is not None and self.seen:
            self._diverge_step(float(x))
        elif self.rules.diverge_ratio is not None:  # the first finite loss starts the state
            if np.isfinite(x):
                self.state[:] = x
            self.report[_L_DEV] = 0.0
            with np.errstate(all="ignore"):  # quiet, or NaN if not finite
                self.report[_L_DIVERGING] = _F(-1.0) + x * _F(0.0)
        self.report[_L_VALUE] = x
        self.seen += math.isfinite(x)
        return self.report

    def _diverge_step(self, x: float) -> None:
        """*diverging*'s state updated in place and its margin (``>= 0`` or NaN: it fires):
        ``min(rise - noise_bar - (ratio - 1) |best|, rise - giveback * learnt)``, in
        ``float32`` arithmetic done on Python floats (:func:`_f32`)."""
        rules, r = self.rules, self.report
        # the running mean's weight, the bars (ratio - 1, overshoot - 1), the share of what was
        # learnt that the noise bar gives up, the noise and giveback shares
        k_mean, k_bar, k_early, k_learnt, k_noise, k_giveback = self._k
        mean, dev, best, first = self.state.tolist()
        # a non-finite loss moves nothing (its deviation counts as 0) and fires through margin
        delta = _f32(x - mean)
        delta = delta if math.isfinite(delta) else 0.0
        mean = _f32(mean + _f32(k_mean * delta))
        best = min(best, mean)  # both finite
        rise, learnt = _f32(mean - best), _f32(first - best)  # learnt >= 0: best never rises
        # the first losses are held to the overshoot bar
        early = self.adaptive and self.seen < rules.diverge_early
        ratio = _f32(rise - _f32((k_early if early else k_bar) * abs(best)))
        if self.seen >= rules.min_history:
            # armed after ``min_history`` losses: the first deviations are a blow-up's own
            noise = max(_f32(dev - _f32(k_learnt * learnt)), 0.0)
            ratio = _f32(ratio - _f32(k_noise * noise))
        giveback = _f32(rise - _f32(k_giveback * learnt))
        r[_L_DIVERGING] = min(ratio, giveback) + x * 0.0  # NaN when the loss is not finite
        # the deviation after the check: a blow-up's own step does not raise its bar
        weight = max(2.0 / (2 * rules.diverge_span + 1), 1.0 / self.seen)
        r[_L_MEAN], r[_L_BEST] = mean, best
        r[_L_DEV] = _lerp32(dev, abs(delta), weight)

    def _spike(self, x: np.float32) -> None:
        """*loss_spike*'s flag and running scale into the report (the scale updated)."""
        assert self.rules.loss_factor is not None
        log_loss = np.log(np.array([x], dtype=np.float32))
        (ceiling,), _, _ = self.scale.thresholds(self.rules.loss_factor)
        positive = np.abs(log_loss) < math.inf
        self.report[_L_SPIKE] = float((positive & (log_loss > ceiling))[0])
        self.report[_L_SCALE] = np.exp(self.scale.mean[0])
        self.scale.update(log_loss, positive, ceiling)

    def state_dict(self) -> dict[str, Any]:
        """The running scale, *diverging*'s state, the losses seen and the current rise."""
        return {
            "loss_scale": torch.from_numpy(self.scale.state.copy()),
            "diverging": torch.from_numpy(self.state.copy()),
            "loss_seen": self.seen,
            "loss_rise": list(self.rise),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; *diverging* starts afresh if the state lacks it."""
        self.scale.load(state["loss_scale"])
        if "diverging" in state:
            self.state[...] = as_array(state["diverging"])
            self.seen = int(state["loss_seen"])
            self.rise = list(state.get("loss_rise", []))


class StallRule:
    """*stall*'s state (the ``_S_*`` rows) and the update's copy to the host."""

    def __init__(self, rules: AlarmRules, device: torch.device) -> None:
        self.rules = rules
        self.state = np.full(_S_BEST + 1, np.nan, dtype=np.float32)
        self._box = HostMailbox((1,), device)
        self.peak_lr = 0.0
        """The largest learning rate seen so far."""

    def due(self, lr: float) -> bool:
        """Whether the rule is on and ``lr`` is at least 1% of its peak so far (the peak
        updated): a schedule decaying it to zero moves the weights below float32's resolution."""
        if self.rules.stall_factor is None or not lr > 0.0:
            return False
        self.peak_lr = max(self.peak_lr, float(lr))
        return not lr < _STALL_LR_FLOOR * self.peak_lr

    def update(
        self, update: torch.Tensor, lr: float, step: int, loss: np.ndarray | None = None
    ) -> None:
        """Post ``update`` (a device scalar: a copy, no sync) for :meth:`read`. ``loss``:
        *diverging*'s state ``[mean, dev, best, first]`` at this step (``None``: the update
        alone decides)."""
        snapshot = None if loss is None else loss.copy()
        self._box.post(update.detach().reshape(1).float(), (step, lr, snapshot))

    def read(self, wait: bool) -> GradientAlarm | None:
        """Evaluate the posted update once its copy is read: the alarm if it fired."""
        got = self._box.read(wait)
        if got is None:
            return None
        value, (step, lr, loss) = got
        with np.errstate(all="ignore"):
            self.evaluate(_F(value[0]), lr, loss)
        return _stall(self.state, step, self.rules) if self.state[_S_FLAG] else None

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
        s[_S_LEVEL] = value if start else _lerp32(float(level), float(target), _STALL_ALPHA)

    def state_dict(self) -> dict[str, Any]:
        """The state and the peak learning rate, on the host."""
        return {"stall": torch.from_numpy(self.state.copy()), "peak_lr": self.peak_lr}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the level starts afresh if the state lacks it."""
        if "stall" in state and tuple(state["stall"].shape) == self.state.shape:
            self.state[...] = as_array(state["stall"])
            self.peak_lr = float(state["peak_lr"])


def _transient(
    step: int, rise: list[float], report: np.ndarray, rules: AlarmRules
) -> GradientAlarm:
    """*transient*'s alarm (logged, never warned): a rise of the loss that met *diverging*'s
    bar for fewer than ``diverge_patience`` losses and fell back below it at ``step``."""
    start, losses, peak = int(rise[0]), int(rise[1]), rise[2]
    best, first = float(report[_L_BEST]), float(report[_L_FIRST])
    text = (
        f"loss transient at optimizer steps {start}-{step}: its running mean rose to {peak:.4g} "
        f"(its best {best:.4g}, its first loss {first:.4g}) for {losses} loss(es) and fell back "
        f"below diverging's bar: a transient the run recovers from, not a divergence "
        f"(diverge_patience={rules.diverge_patience}, diverge_lost={rules.diverge_lost})"
    )
    return GradientAlarm("transient", "loss", step, peak, best, text)


def _stall(report: np.ndarray, step: int, rules: AlarmRules) -> GradientAlarm:
    """*stall*'s alarm from its report (the update per unit of LR and its level, as logs)."""
    value, level = math.exp(report[_S_VALUE]), math.exp(report[_S_BEFORE])
    text = (
        f"learning stalled at optimizer step {step}: the typical update per unit of "
        f"learning rate (median |w_after - w_before| / lr) is {value:.4g}, "
        f"{level / value:.3g}x below its running level {level:.4g} (stall_factor="
        f"{rules.stall_factor}): the optimizer barely moves the weights while the "
        "learning rate says it should"
    )
    if math.isfinite(report[_S_PROGRESS]) and rules.stall_progress < 1.0:
        text += (
            f", and the loss has stopped learning (its best improved by "
            f"{max(report[_S_PROGRESS], 0.0):.1%} of what the run had learnt since the last "
            "logging step)"
        )
    return GradientAlarm("stall", "global", step, value, level, text)


def _loss_spike(step: int, report: np.ndarray, rules: AlarmRules) -> GradientAlarm:
    value, ref = float(report[_L_VALUE]), float(report[_L_SCALE])
    text = (
        f"loss spike at optimizer step {step}: loss {value:.4g} is {value / ref:.3g}x its "
        f"running scale {ref:.4g} (loss_factor={rules.loss_factor}, "
        f"spike_sigmas={rules.spike_sigmas})"
    )
    return GradientAlarm("loss_spike", "loss", step, value, ref, text)


def _diverging(step: int, report: np.ndarray, rules: AlarmRules) -> GradientAlarm:
    value = float(report[_L_VALUE])
    mean, dev, best, first = report[_L_MEAN:].tolist()
    if not math.isfinite(value):
        text = f"loss diverging at optimizer step {step}: the loss is {value}"
        return GradientAlarm("diverging", "loss", step, value, best, text)
    learnt = first - best
    given = f"{(mean - best) / learnt:.0%}" if learnt > 0 else "all"
    text = (
        f"loss diverging at optimizer step {step}: its running mean {mean:.4g} (loss "
        f"{value:.4g}) is {ratio_text(mean / best) if best > 0 else f'+{mean - best:.4g} over'} "
        f"its best {best:.4g} and has given back {given} of what it had learnt since the first "
        f"step's {first:.4g}, beyond the loss's own swings (mean absolute deviation "
        f"{dev:.3g}) (diverge_ratio={rules.diverge_ratio}, "
        f"diverge_giveback={rules.diverge_giveback}, diverge_noise={rules.diverge_noise}, "
        f"diverge_span={rules.diverge_span})"
    )
    return GradientAlarm("diverging", "loss", step, value, best, text)
