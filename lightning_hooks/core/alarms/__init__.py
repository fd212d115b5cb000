"""The every-step check: the alarm rules, their defaults, state, messages and advice."""

from lightning_hooks.core.alarms.gradients import HostSegments
from lightning_hooks.core.alarms.messages import TrainingAlarm
from lightning_hooks.core.alarms.rules import ALARM_RULES, AlarmRules
from lightning_hooks.core.alarms.run_facts import RunFacts
from lightning_hooks.core.alarms.training_alarms import TrainingAlarms

__all__ = [
    "ALARM_RULES",
    "AlarmRules",
    "HostSegments",
    "RunFacts",
    "TrainingAlarm",
    "TrainingAlarms",
]
