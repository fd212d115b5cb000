"""Writing statistics and pictures to every Lightning logger, one sink per kind of logger."""

from lightning_hooks.logging.figures import (
    feature_map_grid,
    grad_flow_figure,
    layer_epoch_heatmap,
    layer_time_figure,
)
from lightning_hooks.logging.sinks import LoggerSink
from lightning_hooks.logging.tensorboard import histogram_raw, step_tag, step_tags
from lightning_hooks.logging.writer import (
    log_embedding,
    log_figure,
    log_histogram,
    log_image,
    log_scalars,
    log_text,
    register_sink,
    save_loggers,
    shows_pictures,
    sinks_for,
    write_dashboards,
)

__all__ = [
    "LoggerSink",
    "feature_map_grid",
    "grad_flow_figure",
    "histogram_raw",
    "layer_epoch_heatmap",
    "layer_time_figure",
    "log_embedding",
    "log_figure",
    "log_histogram",
    "log_image",
    "log_scalars",
    "log_text",
    "register_sink",
    "save_loggers",
    "shows_pictures",
    "sinks_for",
    "step_tag",
    "step_tags",
    "write_dashboards",
]
