"""Writing statistics and pictures to every Lightning logger, through one sink per logger kind.

This module decides which sink adapts which logger, and holds the one guarded way to write to
each.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from matplotlib.figure import Figure

from lightning_hooks.core.hooks.guard import strict_default
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.logging.figures import (
    feature_map_grid,
    grad_flow_figure,
    layer_epoch_heatmap,
    layer_time_figure,
)
from lightning_hooks.logging.sinks import (
    Binned,
    CSVSink,
    LightningLogger,
    LoggerSink,
    MLflowSink,
    WandbSink,
)
from lightning_hooks.logging.tensorboard import TensorBoardSink

if TYPE_CHECKING:
    import torch

__all__ = [
    "Binned",
    "LoggerSink",
    "each_sink",
    "feature_map_grid",
    "grad_flow_figure",
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
]

_KINDS: list[type[LoggerSink]] = [TensorBoardSink, WandbSink, MLflowSink, CSVSink]
"""The kinds of sink, for the process's life: the first that accepts a logger adapts it.
:func:`register_sink` puts the user's first, so a subclass's sink is registered after its
base's."""
_SINKS: weakref.WeakKeyDictionary[LightningLogger, LoggerSink] = weakref.WeakKeyDictionary()
"""One sink per logger for the logger's life, shared by every callback that writes to it (a sink
that failed stays failed, and a TensorBoard sink keeps the charts of its dashboard)."""


def register_sink(kind: type[LoggerSink]) -> type[LoggerSink]:
    """Use ``kind`` for the loggers ``kind.accepts``, ahead of every kind registered before.

    Register a subclass's sink after its base's. Usable as a class decorator.

    Args:
        kind: a subclass of :class:`LoggerSink`, which adapts every logger it accepts from now
            on, for the process's life.

    Returns:
        ``kind``.

    Raises:
        TypeError: ``kind`` is not a subclass of :class:`LoggerSink`.

    Example:
        >>> class MySink(LoggerSink):
        ...     @classmethod
        ...     def accepts(cls, logger):
        ...         return type(logger).__name__ == "MyLogger"
        >>> register_sink(MySink) is MySink
        True
        >>> _KINDS.remove(MySink)
    """
    if not (isinstance(kind, type) and issubclass(kind, LoggerSink)):
        raise TypeError(
            f"register_sink(kind={kind!r}): must be a subclass of LoggerSink, got {type(kind)}"
        )
    _KINDS.insert(0, kind)
    return kind


def sinks_for(loggers: Sequence[LightningLogger]) -> list[LoggerSink]:
    """Return one live sink per distinct logger.

    A logger's sink is made on first use and kept for the logger's life.

    Args:
        loggers: the Trainer's loggers.

    Returns:
        Their sinks, in order, each once; a sink whose client raised is left out.
    """
    sinks: list[LoggerSink] = []
    for logger in loggers:
        sink = _SINKS.get(logger)
        if sink is None:
            kind = next((k for k in _KINDS if k.accepts(logger)), LoggerSink)
            sink = kind(logger)
            _SINKS[logger] = sink
        if sink not in sinks and not sink.failed:
            sinks.append(sink)
    return sinks


def each_sink(loggers: Sequence[LightningLogger], write: Callable[[LoggerSink], None]) -> None:
    """Call ``write`` on each live sink of ``loggers``.

    A sink whose client raises is dropped with one warning and training goes on.

    Args:
        loggers: the Trainer's loggers.
        write: writes to one sink.

    Raises:
        Exception: what a sink's client raised, where ``LIGHTNING_HOOKS_STRICT=1``.
    """
    for sink in sinks_for(loggers):
        _write(sink, write)


def _write(sink: LoggerSink, write: Callable[[LoggerSink], None], *, saves: bool = False) -> None:
    """Call ``write`` on ``sink``; a client that raises is dropped.

    See :func:`each_sink`. The sink is then unsaved, unless ``write`` was its save.
    """
    try:
        write(sink)
        sink.unsaved = not saves
    except Exception as err:
        if strict_default():
            raise
        sink.failed = True
        from pytorch_lightning.utilities import rank_zero_warn

        rank_zero_warn(
            f"lightning_hooks: {type(sink.logger).__name__} raised {type(err).__name__}: "
            f"{err}; nothing more of ours is written to it in this run, training goes on.",
            category=LightningHooksWarning,
        )


def log_scalars(
    loggers: Sequence[LightningLogger], metrics: Mapping[str, float], step: int
) -> None:
    """Send ``metrics`` to every logger, once each (to TensorBoard as one event).

    Args:
        loggers: the Trainer's loggers.
        metrics: the scalars by tag (nothing is written where it is empty).
        step: the step they are logged at.
    """
    if metrics:
        each_sink(loggers, lambda sink: sink.scalars(metrics, step))


def save_loggers(loggers: Sequence[LightningLogger], *, layout: bool = False) -> None:
    """Save each logger written to since its last save, as Lightning does after ``log_metrics``.

    TensorBoard flushes its file. Any of the library's callbacks may call it: the first call
    after a write saves, the others find nothing to save.

    Args:
        loggers: the Trainer's loggers.
        layout: also write the chart layout of the scalars written so far, where it has new
            charts (TensorBoard's custom scalars; rank 0 only).
    """
    for logger in loggers:
        sink = _SINKS.get(logger)
        if sink is None or sink.failed:
            continue
        if layout and sink.has_new_charts():
            _write(sink, lambda s: s.dashboard())
        if sink.unsaved:
            _write(sink, lambda s: s.save(), saves=True)


def shows_pictures(loggers: Sequence[LightningLogger]) -> bool:
    """Return whether figures and images reach any of ``loggers``.

    Args:
        loggers: the Trainer's loggers.

    Returns:
        Whether any live sink of theirs shows pictures.
    """
    return any(sink.shows_pictures for sink in sinks_for(loggers))


def log_figure(loggers: Sequence[LightningLogger], tag: str, figure: Figure, step: int) -> None:
    """Write a matplotlib figure to every logger that shows pictures.

    Args:
        loggers: the Trainer's loggers.
        tag: the figure's tag.
        figure: the figure to write.
        step: the step it is logged at.
    """
    each_sink(loggers, lambda sink: sink.figure(tag, figure, step))


def log_text(loggers: Sequence[LightningLogger], tag: str, text: str, step: int) -> None:
    """Write Markdown ``text`` to every logger that keeps text.

    Args:
        loggers: the Trainer's loggers.
        tag: the text's tag.
        text: the Markdown to write.
        step: the step it is logged at.
    """
    each_sink(loggers, lambda sink: sink.text(tag, text, step))


def log_image(loggers: Sequence[LightningLogger], tag: str, image: torch.Tensor, step: int) -> None:
    """Write a ``CHW`` image tensor in ``[0, 1]`` to every logger that shows pictures.

    Args:
        loggers: the Trainer's loggers.
        tag: the image's tag.
        image: the image, channels first, with values in ``[0, 1]``.
        step: the step it is logged at.
    """
    each_sink(loggers, lambda sink: sink.image(tag, image, step))


def log_embedding(
    loggers: Sequence[LightningLogger],
    tag: str,
    features: torch.Tensor,
    labels: list[Any] | None,
    step: int,
) -> None:
    """Write ``[N, D]`` features (and ``N`` labels) to every logger with a projector.

    Args:
        loggers: the Trainer's loggers.
        tag: the embedding's tag.
        features: ``N`` points of ``D`` features each.
        labels: one label per point, or ``None``.
        step: the step it is logged at.
    """
    each_sink(loggers, lambda sink: sink.embedding(tag, features, labels, step))


def log_histogram(loggers: Sequence[LightningLogger], tag: str, binned: Binned, step: int) -> None:
    """Write a histogram binned on the device to every logger with histograms.

    The loggers with histograms are TensorBoard and W&B.

    Args:
        loggers: the Trainer's loggers.
        tag: the histogram's tag.
        binned: the histogram, binned on the device.
        step: the step it is logged at.
    """
    each_sink(loggers, lambda sink: sink.histogram(tag, binned, step))
