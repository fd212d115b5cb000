"""The torch-only core (no Lightning, matplotlib or TensorBoard); its names load on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from lightning_hooks.lazy import lazy_names

if TYPE_CHECKING:
    from lightning_hooks.core.alarms import ALARM_RULES, AlarmRules, TrainingAlarm, TrainingAlarms
    from lightning_hooks.core.hooks.capture import capture_outputs, probe_mode
    from lightning_hooks.core.hooks.registry import HookRegistry
    from lightning_hooks.core.hooks.selection import (
        Selection,
        is_kind,
        select_modules,
        torch_equivalent,
    )
    from lightning_hooks.core.host_copy import FirstNonFinite
    from lightning_hooks.core.ops.feature_stats import (
        FEATURE_STATS,
        FeatureSummary,
        feature_stats,
    )
    from lightning_hooks.core.ops.grad_stats import GRAD_STATS, ParamLayout, grad_stats
    from lightning_hooks.core.ops.histogram import LayerHistogram, LayerHistograms
    from lightning_hooks.core.ops.tensors import is_training_forward, iter_float_tensors
    from lightning_hooks.core.stats.accumulator import LayerStatsAccumulator, LayerTable
    from lightning_hooks.core.stats.activation_stats import ActivationStatsTracker
    from lightning_hooks.core.stats.alarm_feed import AlarmFeed
    from lightning_hooks.core.stats.dead_units import DeadUnits, DeadUnitTracker
    from lightning_hooks.core.stats.grad_flow import GRAD_FLOW_STATS, GradFlowTracker
    from lightning_hooks.core.stats.layer_time import LayerTimer, LayerTimes
    from lightning_hooks.core.stats.metric_stat import MetricStat
    from lightning_hooks.core.stats.saturation import (
        SATURATING_TYPES,
        SaturatedUnits,
        SaturationTracker,
        saturation_mask,
        unit_saturation,
    )
    from lightning_hooks.core.stats.stability import StabilityStats
    from lightning_hooks.core.stats.stat import LayerStat

# Module (under lightning_hooks.core) -> the public names it defines, imported on first access.
_MODULES = {
    "alarms": "ALARM_RULES AlarmRules TrainingAlarm TrainingAlarms",
    "hooks.capture": "capture_outputs probe_mode",
    "hooks.registry": "HookRegistry",
    "hooks.selection": "Selection is_kind select_modules torch_equivalent",
    "ops.feature_stats": "FEATURE_STATS FeatureSummary feature_stats",
    "ops.grad_stats": "GRAD_STATS ParamLayout grad_stats",
    "ops.histogram": "LayerHistogram LayerHistograms",
    "ops.tensors": "is_training_forward iter_float_tensors",
    "stats.accumulator": "LayerStatsAccumulator LayerTable",
    "stats.activation_stats": "ActivationStatsTracker",
    "stats.alarm_feed": "AlarmFeed",
    "stats.dead_units": "DeadUnits DeadUnitTracker",
    "stats.grad_flow": "GRAD_FLOW_STATS GradFlowTracker",
    "stats.layer_time": "LayerTimer LayerTimes",
    "stats.metric_stat": "MetricStat",
    "stats.saturation": "SATURATING_TYPES SaturatedUnits SaturationTracker saturation_mask "
    "unit_saturation SaturationStats",  # the last: 0.2.0's name of SaturatedUnits, not listed
    "stats.stability": "StabilityStats",
    "stats.stat": "LayerStat",
    "host_copy": "FirstNonFinite",
}
_LAZY = {
    name: f"{__name__}.{module}" for module, names in _MODULES.items() for name in names.split()
}
# A name that is also its module's name (``feature_stats``) is bound now: imported later, the
# submodule would take the package attribute and hide the function. These modules are torch-only.
_SHADOWED = [name for name, module in _LAZY.items() if module.rsplit(".", 1)[1] == name]
globals().update({name: getattr(importlib.import_module(_LAZY[name]), name) for name in _SHADOWED})

__all__ = [
    "ALARM_RULES",
    "FEATURE_STATS",
    "GRAD_FLOW_STATS",
    "GRAD_STATS",
    "SATURATING_TYPES",
    "ActivationStatsTracker",
    "AlarmFeed",
    "AlarmRules",
    "DeadUnitTracker",
    "DeadUnits",
    "FeatureSummary",
    "FirstNonFinite",
    "GradFlowTracker",
    "HookRegistry",
    "LayerHistogram",
    "LayerHistograms",
    "LayerStat",
    "LayerStatsAccumulator",
    "LayerTable",
    "LayerTimer",
    "LayerTimes",
    "MetricStat",
    "ParamLayout",
    "SaturatedUnits",
    "SaturationTracker",
    "Selection",
    "StabilityStats",
    "TrainingAlarm",
    "TrainingAlarms",
    "capture_outputs",
    "feature_stats",
    "grad_stats",
    "is_kind",
    "is_training_forward",
    "iter_float_tensors",
    "probe_mode",
    "saturation_mask",
    "select_modules",
    "torch_equivalent",
    "unit_saturation",
]


__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__)
