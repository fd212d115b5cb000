"""Lightning callbacks that instrument every layer with hooks and log to TensorBoard.

The public names load on first use (PEP 562): ``import lightning_hooks`` or
``import lightning_hooks.core`` imports neither Lightning nor matplotlib nor TensorBoard, and the
``lightning-hooks`` command answers ``--help`` without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_hooks.errors import (
    LightningHooksError,
    LightningHooksWarning,
    TrainingAlarmError,
    TrainingAlarmWarning,
)
from lightning_hooks.lazy import lazy_names

if TYPE_CHECKING:
    from lightning_hooks.callbacks import (
        ActivationStatsCallback,
        DeadReLUCallback,
        FeatureMapCallback,
        GradFlowCallback,
        LayerTimeCallback,
        SaturationCallback,
        StatsCallback,
    )
    from lightning_hooks.core import (
        ActivationStatsTracker,
        AlarmFeed,
        AlarmRules,
        DeadUnitTracker,
        GradFlowTracker,
        HookRegistry,
        LayerStat,
        LayerTable,
        MetricStat,
        Selection,
        TrainingAlarm,
        TrainingAlarms,
        capture_outputs,
        select_modules,
    )

__all__ = [
    "ActivationStatsCallback",
    "ActivationStatsTracker",
    "AlarmFeed",
    "AlarmRules",
    "DeadReLUCallback",
    "DeadUnitTracker",
    "FeatureMapCallback",
    "GradFlowCallback",
    "GradFlowTracker",
    "HookRegistry",
    "LayerStat",
    "LayerTable",
    "LayerTimeCallback",
    "LightningHooksError",
    "LightningHooksWarning",
    "MetricStat",
    "SaturationCallback",
    "Selection",
    "StatsCallback",
    "TrainingAlarm",
    "TrainingAlarmError",
    "TrainingAlarmWarning",
    "TrainingAlarms",
    "capture_outputs",
    "select_modules",
]

__version__ = "0.2.0"


# The public names not defined above: a callback from its subpackage, the rest from the core.
_LAZY = {
    name: "lightning_hooks.callbacks" if name.endswith("Callback") else "lightning_hooks.core"
    for name in __all__
    if name not in globals()
}
__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)
