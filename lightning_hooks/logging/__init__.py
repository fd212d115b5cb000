"""Writing statistics: scalars to Lightning loggers, figures to TensorBoard."""

from lightning_hooks.logging.figures import grad_flow_figure
from lightning_hooks.logging.writer import log_figure, log_scalars, log_text, tensorboard_writers

__all__ = [
    "grad_flow_figure",
    "log_figure",
    "log_scalars",
    "log_text",
    "tensorboard_writers",
]
