"""The Lightning callbacks: each holds the core's statistics and alarms, and runs them in a fit."""

from lightning_hooks.callbacks.activation_stats import ActivationStatsCallback
from lightning_hooks.callbacks.dead_relu import DeadReLUCallback
from lightning_hooks.callbacks.feature_map import FeatureMapCallback
from lightning_hooks.callbacks.grad_flow import GradFlowCallback
from lightning_hooks.callbacks.layer_time import LayerTimeCallback
from lightning_hooks.callbacks.saturation import SaturationCallback
from lightning_hooks.callbacks.stats import StatsCallback

__all__ = [
    "ActivationStatsCallback",
    "DeadReLUCallback",
    "FeatureMapCallback",
    "GradFlowCallback",
    "LayerTimeCallback",
    "SaturationCallback",
    "StatsCallback",
]
