"""Weights & Biases: pictures through ``log_image``, histograms as ``wandb.Histogram``, text as a
table, each at the optimizer step (``trainer/global_step``, as Lightning's ``log_metrics``)."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from matplotlib.figure import Figure

from lightning_hooks.logging.sinks._pictures import figure_pixels, image_pixels
from lightning_hooks.logging.sinks._types import lightning_types
from lightning_hooks.logging.sinks.base import LoggerSink, Moments

__all__ = ["WandbSink"]

_STEP_KEY = "trainer/global_step"
_MAX_BINS = 512  # wandb.Histogram refuses more


def _rebinned(counts: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``counts`` (``edges``: one more) with neighbours merged to at most 512 buckets, the most
    ``wandb.Histogram`` takes.

    Example:
        >>> counts, edges = _rebinned(np.ones(1000), np.arange(1001.0))
        >>> len(counts), len(edges), float(counts.sum()), float(edges[-1])
        (500, 501, 1000.0, 1000.0)
    """
    factor = -(-len(counts) // _MAX_BINS)
    if factor == 1:
        return counts, edges
    padded = np.concatenate([counts, np.zeros((-len(counts)) % factor)])
    return padded.reshape(-1, factor).sum(1), np.append(edges[:-1][::factor], edges[-1])


class WandbSink(LoggerSink):
    """A ``WandbLogger``: figures and images as ``wandb.Image`` (``log_image``), histograms as
    ``wandb.Histogram``, text as a one-row table (``log_text``); no embeddings.

    Example:
        >>> from pytorch_lightning.loggers import CSVLogger
        >>> WandbSink.accepts(CSVLogger("/tmp/x")), WandbSink.shows_pictures
        (False, True)
    """

    shows_pictures: ClassVar[bool] = True

    @classmethod
    def accepts(cls, logger: Any) -> bool:
        return isinstance(logger, lightning_types("WandbLogger"))

    def figure(self, tag: str, figure: Figure, step: int) -> None:
        self.logger.log_image(key=tag, images=[figure_pixels(figure)], step=step)

    def image(self, tag: str, image: Any, step: int) -> None:
        self.logger.log_image(key=tag, images=[image_pixels(image)], step=step)

    def histogram(
        self,
        tag: str,
        limits: np.ndarray,
        counts: np.ndarray,
        step: int,
        moments: Moments | None,
    ) -> None:
        import wandb

        width = limits[1] - limits[0] if len(limits) > 1 else 1.0
        counts, edges = _rebinned(counts, np.concatenate([[limits[0] - width], limits]))
        histogram = wandb.Histogram(np_histogram=(counts.tolist(), edges.tolist()))
        self.logger.experiment.log({tag: histogram, _STEP_KEY: step})

    def text(self, tag: str, text: str, step: int) -> None:
        self.logger.log_text(key=tag, columns=["step", "text"], data=[[step, text]], step=step)
