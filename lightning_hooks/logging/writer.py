"""Everything that writes, to every Lightning logger through its sink (:mod:`.sinks`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure

from lightning_hooks.logging.sinks import each_sink, sinks_for
from lightning_hooks.logging.sinks._types import lightning_types

__all__ = [
    "log_embedding",
    "log_figure",
    "log_image",
    "log_scalars",
    "log_text",
    "save_loggers",
    "shows_pictures",
    "tensorboard_writers",
    "write_dashboards",
]


def tensorboard_writers(loggers: Sequence[Any]) -> list[Any]:
    """The ``SummaryWriter`` of each TensorBoard logger among ``loggers`` (either namespace)."""
    types = lightning_types("TensorBoardLogger")
    return [getattr(logger, "experiment") for logger in loggers if isinstance(logger, types)]  # noqa: B009


def log_scalars(loggers: Sequence[Any], metrics: Mapping[str, float], step: int) -> None:
    """Send ``metrics`` to every logger (TensorBoard, W&B, MLflow, CSV, ...), rank 0 only.

    A plain ``TensorBoardLogger`` gets them as one event holding every value, not one event per
    scalar as its ``log_metrics`` writes (see ``TensorBoardSink.scalars``).
    """
    if metrics:
        each_sink(loggers, lambda sink: sink.scalars(metrics, step))


def save_loggers(loggers: Sequence[Any]) -> None:
    """Save every logger as Lightning does after its own ``log_metrics``: the
    ``TensorBoardLogger`` flushes its event file, so what was written survives a SIGKILL."""
    each_sink(loggers, lambda sink: sink.save())


def write_dashboards(loggers: Sequence[Any]) -> None:
    """Write the chart layout of the scalars logged so far, to each logger that has one."""
    each_sink(loggers, lambda sink: sink.dashboard())


def shows_pictures(loggers: Sequence[Any]) -> bool:
    """Whether figures and images reach any of ``loggers``."""
    return any(sink.shows_pictures for sink in sinks_for(loggers))


def log_figure(loggers: Sequence[Any], tag: str, figure: Figure, step: int) -> None:
    """Write a matplotlib figure to every logger that shows pictures."""
    each_sink(loggers, lambda sink: sink.figure(tag, figure, step))


def log_text(loggers: Sequence[Any], tag: str, text: str, step: int) -> None:
    """Write Markdown ``text`` to every logger that keeps text."""
    each_sink(loggers, lambda sink: sink.text(tag, text, step))


def log_image(loggers: Sequence[Any], tag: str, image: Any, step: int) -> None:
    """Write a ``CHW`` image tensor in ``[0, 1]`` to every logger that shows pictures."""
    each_sink(loggers, lambda sink: sink.image(tag, image, step))


def log_embedding(
    loggers: Sequence[Any], tag: str, features: Any, labels: list[Any] | None, step: int
) -> None:
    """Write ``[N, D]`` features (and ``N`` labels) to every logger with a projector."""
    each_sink(loggers, lambda sink: sink.embedding(tag, features, labels, step))
