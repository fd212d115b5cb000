"""TensorBoard: scalars as one event per logging step, every picture, the custom dashboard."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from matplotlib.figure import Figure

from lightning_hooks.logging.dashboard import record_tags, write_dashboard
from lightning_hooks.logging.histograms import histogram_raw
from lightning_hooks.logging.sinks._crc import fast_tensorboard_crc
from lightning_hooks.logging.sinks._summary import scalar_summary
from lightning_hooks.logging.sinks._types import lightning_types
from lightning_hooks.logging.sinks.base import LoggerSink, Moments

__all__ = ["TensorBoardSink"]


class TensorBoardSink(LoggerSink):
    """A ``TensorBoardLogger`` (either namespace, or a subclass): its ``SummaryWriter`` gets
    figures, images, histograms, text, embeddings and the custom-scalars layout.

    Example:
        >>> from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
        >>> TensorBoardSink.accepts(TensorBoardLogger("/tmp/x")), TensorBoardSink.accepts(
        ...     CSVLogger("/tmp/x"))
        (True, False)
    """

    shows_pictures: ClassVar[bool] = True

    def __init__(self, logger: Any) -> None:
        super().__init__(logger)
        fast_tensorboard_crc()  # the event files' checksums in C (``_crc.py``), once

    @classmethod
    def accepts(cls, logger: Any) -> bool:
        return isinstance(logger, lightning_types("TensorBoardLogger"))

    @property
    def _writer(self) -> Any:
        return self.logger.experiment

    def scalars(self, metrics: Mapping[str, float], step: int) -> None:
        """One event holding every value (what :meth:`_write_summary` does), not one event per
        scalar as the logger's ``log_metrics`` writes: the same tags, steps and values in the
        file, one queue hand-off to its writer thread instead of one per scalar (a logging step
        writes a hundred or more)."""
        if not self._write_summary(metrics, step):
            self.logger.log_metrics(dict(metrics), step=step)
        record_tags(self._writer, metrics)

    def _write_summary(self, metrics: Mapping[str, float], step: int) -> bool:
        """``metrics`` as one TensorBoard event, ``simple_value`` per tag as ``add_scalar`` writes
        them; ``False`` (nothing written) unless the logger is a TensorBoardLogger itself (not a
        subclass, which may log otherwise) with no prefix, whose writer is torch's
        ``SummaryWriter`` (on ranks other than 0 it is Lightning's dummy: its ``log_metrics``
        does nothing there)."""
        prefix: str = getattr(self.logger, "_prefix", "")
        if type(self.logger) not in lightning_types("TensorBoardLogger") or prefix:
            return False
        from torch.utils.tensorboard import SummaryWriter

        writer = self._writer
        if not isinstance(writer, SummaryWriter):
            return False
        writer._get_file_writer().add_summary(scalar_summary(metrics), step)  # type: ignore[no-untyped-call]
        return True

    def figure(self, tag: str, figure: Figure, step: int) -> None:
        self._writer.add_figure(tag, figure, global_step=step, close=False)

    def image(self, tag: str, image: Any, step: int) -> None:
        self._writer.add_image(tag, image, global_step=step, dataformats="CHW")

    def histogram(
        self,
        tag: str,
        limits: np.ndarray,
        counts: np.ndarray,
        step: int,
        moments: Moments | None,
    ) -> None:
        raw = histogram_raw(limits, counts, moments)
        self._writer.add_histogram_raw(tag, global_step=step, **raw)

    def text(self, tag: str, text: str, step: int) -> None:
        self._writer.add_text(tag, text, global_step=step)

    def embedding(self, tag: str, features: Any, labels: list[Any] | None, step: int) -> None:
        self._writer.add_embedding(features, metadata=labels, global_step=step, tag=tag)

    def dashboard(self) -> None:
        write_dashboard([self._writer])
