"""Lightning callbacks that instrument every layer with hooks and log to TensorBoard.

The public names load on first use (PEP 562): ``import lightning_hooks`` or
``import lightning_hooks.core`` imports neither Lightning nor matplotlib nor TensorBoard, and the
``lightning-hooks`` command answers ``--help`` without importing torch.

Example:
    >>> from lightning_hooks import GradFlowCallback
    >>> callback = GradFlowCallback()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_hooks._lazy import lazy_names
from lightning_hooks.errors import (
    GradientAlarmError,
    GradientAlarmWarning,
    LightningHooksError,
    LightningHooksWarning,
)

if TYPE_CHECKING:
    from lightning_hooks.callbacks.activation_stats import ActivationStatsCallback
    from lightning_hooks.callbacks.dead_relu import DeadReLUCallback
    from lightning_hooks.callbacks.feature_map import FeatureMapCallback
    from lightning_hooks.callbacks.grad_flow import GradFlowCallback
    from lightning_hooks.callbacks.layer_time import LayerTimeCallback
    from lightning_hooks.callbacks.saturation import SaturationCallback
    from lightning_hooks.callbacks.stats import StatsCallback
    from lightning_hooks.core.alarms import AlarmRules, GradientAlarm, GradientAlarms
    from lightning_hooks.core.hooks.capture import capture_outputs
    from lightning_hooks.core.hooks.registry import HookRegistry
    from lightning_hooks.core.hooks.selection import select_modules
    from lightning_hooks.core.stats.accumulator import LayerTable
    from lightning_hooks.core.stats.activation_stats import ActivationStatsTracker
    from lightning_hooks.core.stats.dead_units import DeadUnitTracker
    from lightning_hooks.core.stats.grad_flow import GradFlowTracker

# Public name -> the module that defines it, imported on first attribute access.
_LAZY: dict[str, str] = {
    "ActivationStatsCallback": "lightning_hooks.callbacks.activation_stats",
    "DeadReLUCallback": "lightning_hooks.callbacks.dead_relu",
    "FeatureMapCallback": "lightning_hooks.callbacks.feature_map",
    "GradFlowCallback": "lightning_hooks.callbacks.grad_flow",
    "LayerTimeCallback": "lightning_hooks.callbacks.layer_time",
    "SaturationCallback": "lightning_hooks.callbacks.saturation",
    "StatsCallback": "lightning_hooks.callbacks.stats",
    "LayerTable": "lightning_hooks.core.stats.accumulator",
    "ActivationStatsTracker": "lightning_hooks.core.stats.activation_stats",
    "AlarmRules": "lightning_hooks.core.alarms",
    "GradientAlarm": "lightning_hooks.core.alarms",
    "GradientAlarms": "lightning_hooks.core.alarms",
    "capture_outputs": "lightning_hooks.core.hooks.capture",
    "DeadUnitTracker": "lightning_hooks.core.stats.dead_units",
    "GradFlowTracker": "lightning_hooks.core.stats.grad_flow",
    "HookRegistry": "lightning_hooks.core.hooks.registry",
    "select_modules": "lightning_hooks.core.hooks.selection",
}

__all__ = [
    "ActivationStatsCallback",
    "ActivationStatsTracker",
    "AlarmRules",
    "DeadReLUCallback",
    "DeadUnitTracker",
    "FeatureMapCallback",
    "GradFlowCallback",
    "GradFlowTracker",
    "GradientAlarm",
    "GradientAlarmError",
    "GradientAlarmWarning",
    "GradientAlarms",
    "HookRegistry",
    "LayerTable",
    "LayerTimeCallback",
    "LightningHooksError",
    "LightningHooksWarning",
    "SaturationCallback",
    "StatsCallback",
    "capture_outputs",
    "select_modules",
]

__version__ = "0.2.0"


__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)
