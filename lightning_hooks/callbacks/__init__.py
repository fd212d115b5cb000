"""Lightning callbacks: thin adapters over the core."""

from lightning_hooks.callbacks.grad_flow import GradFlowCallback

__all__ = ["GradFlowCallback"]
