"""Writing statistics: scalars to Lightning loggers, figures to TensorBoard."""

from lightning_hooks.logging.figures import grad_flow_figure, layer_epoch_heatmap
from lightning_hooks.logging.histograms import log_histogram_raw
from lightning_hooks.logging.writer import log_figure, log_scalars, log_text, tensorboard_writers

__all__ = [
    "grad_flow_figure",
    "layer_epoch_heatmap",
    "log_figure",
    "log_histogram_raw",
    "log_scalars",
    "log_text",
    "tensorboard_writers",
]
