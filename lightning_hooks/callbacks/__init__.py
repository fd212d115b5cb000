"""Lightning callbacks: thin adapters over the core."""

from lightning_hooks.callbacks.activation_stats import ActivationStatsCallback
from lightning_hooks.callbacks.dead_relu import DeadReLUCallback
from lightning_hooks.callbacks.grad_flow import GradFlowCallback

__all__ = ["ActivationStatsCallback", "DeadReLUCallback", "GradFlowCallback"]
