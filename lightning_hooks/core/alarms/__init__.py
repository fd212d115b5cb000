"""The every-step sentinel: the alarm rules and their defaults, their host state, messages."""

from lightning_hooks.core.alarms.gradients import HostSegments
from lightning_hooks.core.alarms.messages import GradientAlarm
from lightning_hooks.core.alarms.rules import ALARM_RULES, AlarmRules
from lightning_hooks.core.alarms.sentinel import GradientAlarms

__all__ = ["ALARM_RULES", "AlarmRules", "GradientAlarm", "GradientAlarms", "HostSegments"]
