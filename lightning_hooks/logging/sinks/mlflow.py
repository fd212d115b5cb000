"""MLflow: figures with ``log_figure``, text with ``log_text``, images with ``log_image`` at their
step, through the ``MlflowClient`` that ``MLFlowLogger.experiment`` is."""

from __future__ import annotations

import re
from typing import Any, ClassVar

from matplotlib.figure import Figure

from lightning_hooks.logging.sinks._pictures import image_pixels
from lightning_hooks.logging.sinks._types import lightning_types
from lightning_hooks.logging.sinks.base import LoggerSink

__all__ = ["MLflowSink", "artifact_file"]

_UNSAFE = re.compile(r"[^a-zA-Z0-9_/. -]+")


def artifact_file(tag: str, step: int, suffix: str) -> str:
    """The artifact path of ``tag`` at ``step``: one folder per tag, the step in the name.

    Example:
        >>> artifact_file("grad_flow/chart", 80, ".png")
        'grad_flow/chart/step_000080.png'
    """
    return f"{tag}/step_{step:06d}{suffix}"


class MLflowSink(LoggerSink):
    """An ``MLFlowLogger``: figures as ``<tag>/step_<step>.png`` artifacts, images as MLflow
    images under their key and step, Markdown text as ``<tag>/step_<step>.md``; no histograms
    or embeddings (MLflow has neither).

    Example:
        >>> from pytorch_lightning.loggers import CSVLogger
        >>> MLflowSink.accepts(CSVLogger("/tmp/x")), MLflowSink.shows_pictures
        (False, True)
    """

    shows_pictures: ClassVar[bool] = True

    @classmethod
    def accepts(cls, logger: Any) -> bool:
        return isinstance(logger, lightning_types("MLFlowLogger"))

    def figure(self, tag: str, figure: Figure, step: int) -> None:
        client = self.logger.experiment
        client.log_figure(self.logger.run_id, figure, artifact_file(tag, step, ".png"))

    def image(self, tag: str, image: Any, step: int) -> None:
        # The key follows MLflow's metric-name rules, as Lightning's log_metrics cleans its keys.
        key = _UNSAFE.sub("", tag)
        self.logger.experiment.log_image(
            self.logger.run_id, image_pixels(image), key=key, step=step
        )

    def text(self, tag: str, text: str, step: int) -> None:
        client = self.logger.experiment
        client.log_text(self.logger.run_id, text, artifact_file(tag, step, ".md"))
