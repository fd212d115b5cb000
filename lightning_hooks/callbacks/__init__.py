"""Lightning callbacks: thin adapters over the core."""

from lightning_hooks.callbacks.feature_map import FeatureMapCallback
from lightning_hooks.callbacks.grad_flow import GradFlowCallback
from lightning_hooks.callbacks.layer_time import LayerTimeCallback
from lightning_hooks.callbacks.saturation import SaturationCallback

__all__ = [
    "FeatureMapCallback",
    "GradFlowCallback",
    "LayerTimeCallback",
    "SaturationCallback",
]
