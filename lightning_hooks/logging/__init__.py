"""Writing statistics: scalars to Lightning loggers, figures to TensorBoard."""

from lightning_hooks.logging.figures import grad_flow_figure, layer_time_figure
from lightning_hooks.logging.writer import log_figure, log_scalars, tensorboard_writers

__all__ = [
    "grad_flow_figure",
    "layer_time_figure",
    "log_figure",
    "log_scalars",
    "tensorboard_writers",
]
