"""The writer interface: what our callbacks write, and one adapter per kind of logger."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from matplotlib.figure import Figure

__all__ = ["LoggerSink", "Moments"]

Moments = tuple[float, float, float, float]
"""``(min, max, sum, sum of squares)`` of the values a histogram binned."""


class LoggerSink:
    """One Lightning logger as the library writes to it: one subclass per kind of logger.

    Every method gets host values (numpy arrays, CPU tensors, matplotlib figures) and the
    optimizer step; a kind of logger that cannot show something keeps the default, which writes
    nothing. :meth:`scalars` and :meth:`save` default to the logger's own ``log_metrics`` and
    ``save``, what Lightning calls for any logger. A subclass names the logger classes it adapts
    in :meth:`accepts` and is registered with
    :func:`~lightning_hooks.logging.sinks.register_sink`.

    Attributes:
        logger: the Lightning logger written to.
        shows_pictures: whether figures and images reach this logger.

    Example:
        >>> sink = LoggerSink(object())
        >>> sink.shows_pictures, LoggerSink.accepts(object())
        (False, True)
    """

    shows_pictures: ClassVar[bool] = False

    def __init__(self, logger: Any) -> None:
        self.logger = logger

    @classmethod
    def accepts(cls, logger: Any) -> bool:
        """Whether this sink adapts ``logger``; the base adapts any logger (scalars only)."""
        return True

    def scalars(self, metrics: Mapping[str, float], step: int) -> None:
        """Write ``metrics`` at ``step`` (the logger's own ``log_metrics``)."""
        self.logger.log_metrics(dict(metrics), step=step)

    def figure(self, tag: str, figure: Figure, step: int) -> None:
        """Write a matplotlib figure (the caller closes it)."""

    def image(self, tag: str, image: Any, step: int) -> None:
        """Write a ``CHW`` CPU image tensor with values in ``[0, 1]``."""

    def histogram(
        self,
        tag: str,
        limits: np.ndarray,
        counts: np.ndarray,
        step: int,
        moments: Moments | None,
    ) -> None:
        """Write pre-binned ``counts`` with right edges ``limits`` (see ``histogram_raw``)."""

    def text(self, tag: str, text: str, step: int) -> None:
        """Write Markdown ``text``."""

    def embedding(self, tag: str, features: Any, labels: list[Any] | None, step: int) -> None:
        """Write ``[N, D]`` features and their ``N`` labels for a projector."""

    def dashboard(self) -> None:
        """Write the layout of the charts of the scalars written so far, where one exists."""

    def save(self) -> None:
        """Persist what was written (the logger's own ``save``)."""
        self.logger.save()
