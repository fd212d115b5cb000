"""The library's warning and exception types."""

from __future__ import annotations

from typing import Any

__all__ = [
    "GradientAlarmError",
    "GradientAlarmWarning",
    "LightningHooksError",
    "LightningHooksWarning",
]


class LightningHooksWarning(UserWarning):
    """Every warning the library emits: filter them with this one category."""


class LightningHooksError(RuntimeError):
    """Raised by the library when training must not go on."""


class GradientAlarmWarning(LightningHooksWarning):
    """A gradient alarm (spike, vanishing, non-finite, ...): the message names rule, layer, step.

    Attributes:
        alarm: the :class:`~lightning_hooks.core.GradientAlarm` (values, recent norms), or ``None``.
    """

    alarm: Any = None


class GradientAlarmError(LightningHooksError):
    """A gradient alarm with ``on_alarm="raise"``: carries the facts of the alarm.

    Attributes:
        rule: the rule that fired (``"explosion"``, ``"nonfinite"``, ``"diverging"``, ...).
        layer: the layer it names (``"global"`` for all layers together).
        step: the optimizer step whose gradients fired it.
        value: the gradient norm (or loss) that fired it.
        alarm: the :class:`~lightning_hooks.core.GradientAlarm`, or ``None``.
    """

    def __init__(
        self, message: str, *, rule: str, layer: str, step: int, value: float, alarm: Any = None
    ) -> None:
        super().__init__(message)
        self.rule = rule
        self.layer = layer
        self.step = step
        self.value = value
        self.alarm = alarm
