"""CSVLogger: figures and images as PNG files under its ``log_dir``, text as Markdown beside
``metrics.csv``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from matplotlib.figure import Figure

from lightning_hooks.logging.sinks._pictures import figure_pixels, image_pixels, png_bytes
from lightning_hooks.logging.sinks._types import lightning_types
from lightning_hooks.logging.sinks.base import LoggerSink

__all__ = ["CSVSink", "text_file"]


def text_file(tag: str) -> str:
    """The Markdown file of ``tag``'s text, beside ``metrics.csv``.

    Example:
        >>> text_file("grad_flow/alarms")
        'grad_flow.alarms.md'
    """
    return tag.replace("/", ".") + ".md"


class CSVSink(LoggerSink):
    """A ``CSVLogger``: ``<log_dir>/<tag>/step_<step>.png`` per figure or image (one folder per
    tag), ``<log_dir>/<tag with dots>.md`` gathering every step's text under a heading per
    step; no histograms or embeddings.

    Example:
        >>> from pytorch_lightning.loggers import CSVLogger
        >>> CSVSink.accepts(CSVLogger("/tmp/x")), CSVSink.shows_pictures
        (True, True)
    """

    shows_pictures: ClassVar[bool] = True

    @classmethod
    def accepts(cls, logger: Any) -> bool:
        return isinstance(logger, lightning_types("CSVLogger"))

    def _log_dir(self) -> Path | None:
        """The run's folder; ``None`` on ranks other than 0 (their experiment is a dummy)."""
        log_dir = getattr(self.logger.experiment, "log_dir", None)
        return Path(log_dir) if isinstance(log_dir, str) else None

    def _write_png(self, tag: str, step: int, png: bytes) -> None:
        log_dir = self._log_dir()
        if log_dir is None:
            return
        path = log_dir / tag / f"step_{step:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png)

    def figure(self, tag: str, figure: Figure, step: int) -> None:
        self._write_png(tag, step, png_bytes(figure_pixels(figure)))

    def image(self, tag: str, image: Any, step: int) -> None:
        self._write_png(tag, step, png_bytes(image_pixels(image)))

    def text(self, tag: str, text: str, step: int) -> None:
        log_dir = self._log_dir()
        if log_dir is None:
            return
        log_dir.mkdir(parents=True, exist_ok=True)
        with (log_dir / text_file(tag)).open("a", encoding="utf-8") as file:
            file.write(f"## {tag}, step {step}\n\n{text}\n\n")
