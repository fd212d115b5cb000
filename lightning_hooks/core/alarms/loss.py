"""The loss rules on the device: *loss_spike* and *diverging*, their state and their report."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lightning_hooks.core.alarms.messages import GradientAlarm, diverging_fires, loss_alarms
from lightning_hooks.core.alarms.rules import (
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
from lightning_hooks.core.alarms.scale import RunningScale
from lightning_hooks.core.transport.readback import HostMailbox

__all__ = ["LossRules"]


class LossRules:
    """*loss_spike* and *diverging* on one training loss per step (a device scalar; no host
    sync), posted to the host as one small report.

    The report is also *diverging*'s state (its last four entries, updated in place): one
    buffer, posted as is, so a quiet step is a few fused scalar kernels.

    Args:
        rules: the rules and thresholds.
        device: where the state lives.
    """

    def __init__(self, rules: AlarmRules, device: torch.device) -> None:
        self.rules = rules
        self.scale = RunningScale(1, rules, device)
        self.report = torch.zeros(_L_FIRST + 1, device=device)
        self.report[_L_SCALE] = math.nan
        self.state = self.report[_L_MEAN:]
        self._views = self.report.unbind(0)
        self.seen = 0
        """Finite losses in the state, counted on the host from the reports."""
        self.adaptive = False
        """The optimizer keeps a second moment: its first ``diverge_early`` losses are held to
        the ``diverge_overshoot`` bar (:meth:`GradientAlarms.set_adaptive`)."""
        self._box = HostMailbox((_L_FIRST + 1,), device)

    def update(self, loss: torch.Tensor, step: int) -> None:
        """Apply the rules to ``loss`` and post the report (read the previous one first:
        :meth:`read` counts the finite losses that :attr:`seen` needs)."""
        x = loss if loss.dim() == 0 else loss.reshape(())
        x = x if x.dtype == torch.float32 else x.float()
        if self.rules.loss_factor is not None:
            self._spike(x)
        margin = self._views[_L_DIVERGING]
        if self.rules.diverge_ratio is None:
            pass
        elif self.seen == 0:
            self._diverge_start(x, margin)
        else:
            self._diverge_step(x, margin)
        self._views[_L_VALUE].copy_(x)
        self._box.post(self.report, step)

    def read(self, wait: bool) -> tuple[int, list[GradientAlarm]] | None:
        """The step and alarms of the posted report once read, when a rule fired; else
        ``None``."""
        got = self._box.read(wait)
        if got is None:
            return None
        report, step = got
        self.seen += bool(np.isfinite(report[_L_VALUE]))
        if not (report[_L_SPIKE] > 0 or diverging_fires(report, self.rules)):
            return None
        return step, loss_alarms(step, report.copy(), self.rules)

    def _diverge_start(self, x: torch.Tensor, margin: torch.Tensor) -> None:
        """The first finite loss starts the state (running mean, best and first loss)."""
        finite = torch.lt(x.abs(), math.inf)
        torch.where(finite, x, self.state, out=self.state)
        self._views[_L_DEV].zero_()
        margin.fill_(-1.0).add_(x, alpha=0.0)  # quiet, or NaN if the loss is not finite

    def _diverge_step(self, x: torch.Tensor, margin: torch.Tensor) -> None:
        """*diverging*'s state updated in place and its margin (``>= 0`` or NaN: it fires):
        ``min(rise - noise_bar - (ratio - 1) |best|, rise - giveback * learnt)``."""
        rules = self.rules
        assert rules.diverge_ratio is not None
        mean, dev, best, first = self._views[_L_MEAN:]
        # a non-finite loss moves nothing (its deviation counts as 0) and fires through margin
        delta = torch.sub(x, mean).nan_to_num_(0.0, 0.0, 0.0)
        mean.add_(delta, alpha=2.0 / (rules.diverge_span + 1))
        torch.minimum(best, mean, out=best)
        rise = torch.sub(mean, best)
        learnt = torch.sub(first, best)  # >= 0: the best never rises above the first loss
        # the first losses are held to the overshoot bar (a Python number: no extra kernel)
        early = self.adaptive and self.seen < rules.diverge_early
        bar = rules.diverge_overshoot if early else rules.diverge_ratio
        ratio = torch.sub(rise, best.abs(), alpha=bar - 1.0)
        if self.seen >= rules.min_history:
            # the noise bar is armed once it has ``min_history`` losses, as the spike rules
            # are: the deviation of the first one or two is a blow-up's own first steps
            noise = torch.sub(dev, learnt, alpha=1.0 / _LEARNT_NOISE).clamp_min_(0.0)
            ratio.sub_(noise, alpha=rules.diverge_noise)
        giveback = torch.sub(rise, learnt, alpha=rules.diverge_giveback)
        torch.minimum(ratio, giveback, out=margin).add_(x, alpha=0.0)
        # the deviation after the check: a blow-up's own step does not raise its bar
        weight = max(2.0 / (2 * rules.diverge_span + 1), 1.0 / self.seen)
        dev.lerp_(delta.abs_(), weight)

    def _spike(self, x: torch.Tensor) -> None:
        """*loss_spike*'s flag and running scale into the report (the scale updated)."""
        assert self.rules.loss_factor is not None
        log_loss = x.log()
        ceiling, _ = self.scale.threshold(self.rules.loss_factor)
        positive = log_loss.abs() < math.inf
        self.report[_L_SPIKE : _L_SPIKE + 1].copy_(positive & (log_loss > ceiling))
        self.report[_L_SCALE : _L_SCALE + 1].copy_(self.scale.mean.exp())
        self.scale.update(log_loss, positive, ceiling)

    def state_dict(self) -> dict[str, Any]:
        """The running scale, *diverging*'s state and the finite losses seen, on the host."""
        return {
            "loss_scale": self.scale.state.cpu(),
            "diverging": self.state.cpu(),
            "loss_seen": self.seen,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; an older state's *diverging* starts again."""
        self.scale.state.copy_(state["loss_scale"])
        if "diverging" in state:
            self.state.copy_(state["diverging"])
            self.seen = int(state["loss_seen"])
