"""Lightning callbacks that instrument every layer with hooks and log to TensorBoard.

Example:
    >>> from lightning_hooks import GradFlowCallback
    >>> callback = GradFlowCallback()
"""

from lightning_hooks.callbacks import GradFlowCallback
from lightning_hooks.callbacks.activation_stats import ActivationStatsCallback
from lightning_hooks.callbacks.dead_relu import DeadReLUCallback
from lightning_hooks.callbacks.feature_map import FeatureMapCallback
from lightning_hooks.callbacks.layer_time import LayerTimeCallback
from lightning_hooks.callbacks.saturation import SaturationCallback
from lightning_hooks.core import (
    AlarmRules,
    GradFlowTracker,
    GradientAlarm,
    GradientAlarms,
    HookRegistry,
    LayerStats,
    select_modules,
)
from lightning_hooks.core.activation_stats import ActivationStatsTracker
from lightning_hooks.core.capture import capture_outputs
from lightning_hooks.core.dead_units import DeadUnitTracker
from lightning_hooks.errors import (
    GradientAlarmError,
    GradientAlarmWarning,
    LightningHooksError,
    LightningHooksWarning,
)

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
    "LayerStats",
    "LayerTimeCallback",
    "LightningHooksError",
    "LightningHooksWarning",
    "SaturationCallback",
    "capture_outputs",
    "select_modules",
]

__version__ = "0.1.0"
