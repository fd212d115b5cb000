"""The torch-only core: hook registry, module selection, statistics and accumulators."""

from lightning_hooks.core.accumulator import LayerStats, LayerStatsAccumulator
from lightning_hooks.core.activation_stats import ActivationStatsTracker
from lightning_hooks.core.alarms import ALARM_RULES, AlarmRules, GradientAlarm, GradientAlarms
from lightning_hooks.core.capture import capture_outputs
from lightning_hooks.core.dead_units import DeadUnits, DeadUnitTracker
from lightning_hooks.core.feature_stats import FEATURE_STATS, FeatureSummary, feature_stats
from lightning_hooks.core.grad_flow import GRAD_FLOW_STATS, GradFlowTracker
from lightning_hooks.core.grad_stats import GRAD_STATS, ParamLayout, grad_stats
from lightning_hooks.core.histogram import LayerHistogram, LayerHistograms
from lightning_hooks.core.layer_time import LayerTimer, LayerTimes
from lightning_hooks.core.nonfinite import FirstNonFinite
from lightning_hooks.core.probe import probe_mode
from lightning_hooks.core.registry import HookRegistry
from lightning_hooks.core.saturation import (
    SATURATING_TYPES,
    SaturationStats,
    SaturationTracker,
    saturation_mask,
    unit_saturation,
)
from lightning_hooks.core.selection import Selection, select_modules
from lightning_hooks.core.stat import LayerStat
from lightning_hooks.core.tensors import is_training_forward, iter_float_tensors

__all__ = [
    "ALARM_RULES",
    "FEATURE_STATS",
    "GRAD_FLOW_STATS",
    "GRAD_STATS",
    "SATURATING_TYPES",
    "ActivationStatsTracker",
    "AlarmRules",
    "DeadUnitTracker",
    "DeadUnits",
    "FeatureSummary",
    "FirstNonFinite",
    "GradFlowTracker",
    "GradientAlarm",
    "GradientAlarms",
    "HookRegistry",
    "LayerHistogram",
    "LayerHistograms",
    "LayerStat",
    "LayerStats",
    "LayerStatsAccumulator",
    "LayerTimer",
    "LayerTimes",
    "ParamLayout",
    "SaturationStats",
    "SaturationTracker",
    "Selection",
    "capture_outputs",
    "feature_stats",
    "grad_stats",
    "is_training_forward",
    "iter_float_tensors",
    "probe_mode",
    "saturation_mask",
    "select_modules",
    "unit_saturation",
]
