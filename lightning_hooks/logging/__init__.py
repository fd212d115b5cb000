"""Writing statistics: scalars to Lightning loggers, figures to TensorBoard."""

from lightning_hooks.logging.figures import grad_flow_figure, layer_time_figure
from lightning_hooks.logging.images import feature_map_grid
from lightning_hooks.logging.writer import (
    log_embedding,
    log_figure,
    log_image,
    log_scalars,
    tensorboard_writers,
)

__all__ = [
    "feature_map_grid",
    "grad_flow_figure",
    "layer_time_figure",
    "log_embedding",
    "log_figure",
    "log_image",
    "log_scalars",
    "tensorboard_writers",
]
