"""Lightning callbacks: thin adapters over the core."""

from lightning_hooks.callbacks.grad_flow import GradFlowCallback
from lightning_hooks.callbacks.layer_time import LayerTimeCallback

__all__ = ["GradFlowCallback", "LayerTimeCallback"]
