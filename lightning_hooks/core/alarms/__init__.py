"""The every-step sentinel: the alarm rules and their defaults, their device state, messages."""

from lightning_hooks.core.alarms.sentinel import (
    ALARM_RULES,
    AlarmRules,
    GradientAlarm,
    GradientAlarms,
)

__all__ = ["ALARM_RULES", "AlarmRules", "GradientAlarm", "GradientAlarms"]
