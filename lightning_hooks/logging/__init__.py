"""Writing statistics and pictures to every Lightning logger, one sink per kind of logger."""

from lightning_hooks.logging.dashboard import (
    dashboard_layout,
    record_tags,
    step_tag,
    step_tags,
    write_dashboard,
)
from lightning_hooks.logging.figures import grad_flow_figure, layer_epoch_heatmap, layer_time_figure
from lightning_hooks.logging.histograms import histogram_raw, log_histogram
from lightning_hooks.logging.images import feature_map_grid
from lightning_hooks.logging.sinks import LoggerSink, register_sink, sinks_for
from lightning_hooks.logging.writer import (
    log_embedding,
    log_figure,
    log_image,
    log_scalars,
    log_text,
    save_loggers,
    shows_pictures,
    tensorboard_writers,
    write_dashboards,
)

__all__ = [
    "LoggerSink",
    "dashboard_layout",
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
    "record_tags",
    "register_sink",
    "save_loggers",
    "shows_pictures",
    "sinks_for",
    "step_tag",
    "step_tags",
    "tensorboard_writers",
    "write_dashboard",
    "write_dashboards",
]
