"""The writer interface, :class:`LoggerSink`, and its adapters for CSV, MLflow and W&B loggers.

TensorBoard's adapter is in :mod:`.tensorboard`.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

if TYPE_CHECKING:
    import torch

__all__ = [
    "Binned",
    "CSVSink",
    "LightningLogger",
    "LoggerSink",
    "MLflowSink",
    "Moments",
    "WandbSink",
    "lightning_types",
]

Moments = tuple[float, float, float, float]
"""``(min, max, sum, sum of squares)`` of the values a histogram binned."""


class Binned(NamedTuple):
    """A histogram binned on the device, as a sink writes it."""

    limits: np.ndarray
    """``[buckets]`` right edges of the buckets."""
    counts: np.ndarray
    """``[buckets]`` counts."""
    moments: Moments | None = None
    """Of the values binned; ``None``: taken from the bucket centres when a sink needs them."""


# Fabric's loggers last: the Trainer's TensorBoardLogger and CSVLogger subclass them.
_NAMESPACES = (
    "pytorch_lightning.loggers",
    "lightning.pytorch.loggers",
    "lightning_fabric.loggers",
    "lightning.fabric.loggers",
)


class LightningLogger(Protocol):
    """What a sink calls on any logger: a Lightning ``Logger`` of either namespace, or Fabric's."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Write ``metrics`` at ``step``.

        Args:
            metrics: the scalars by tag.
            step: the step they are logged at.
        """

    def save(self) -> None:
        """Persist what was written."""


class _CSVLogger(LightningLogger, Protocol):
    """A ``CSVLogger``: its experiment has the run's ``log_dir`` (not on ranks > 0)."""

    @property
    def experiment(self) -> object:
        """The experiment writer (a dummy one on ranks > 0)."""


class _MlflowClient(Protocol):
    """The calls of an ``MlflowClient`` that :class:`MLflowSink` makes."""

    def log_figure(self, run_id: str, figure: Figure, artifact_file: str) -> None:
        """Store ``figure`` as the run's artifact ``artifact_file``.

        Args:
            run_id: the run the artifact belongs to.
            figure: the figure to store.
            artifact_file: the artifact's path in the run.
        """

    def log_image(self, run_id: str, image: np.ndarray, *, key: str, step: int) -> None:
        """Store an image under ``key`` at ``step``.

        Args:
            run_id: the run the image belongs to.
            image: the image's pixels.
            key: the image's name in the run.
            step: the step it is logged at.
        """

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        """Store ``text`` as the run's artifact ``artifact_file``.

        Args:
            run_id: the run the artifact belongs to.
            text: the text to store.
            artifact_file: the artifact's path in the run.
        """


class _MlflowLogger(LightningLogger, Protocol):
    """An ``MLFlowLogger``: its client and run."""

    @property
    def experiment(self) -> _MlflowClient:
        """The run's ``MlflowClient``."""

    @property
    def run_id(self) -> str:
        """The run written to."""


class _WandbRun(Protocol):
    """The call of a W&B run that :class:`WandbSink` makes."""

    def log(self, data: dict[str, Any]) -> None:
        """Log ``data`` (its step among its values).

        Args:
            data: the values by key, the step under ``"trainer/global_step"``.
        """


class _WandbLogger(LightningLogger, Protocol):
    """A ``WandbLogger``: its own image and table writers, and its run."""

    @property
    def experiment(self) -> _WandbRun:
        """The W&B run."""

    def log_image(self, key: str, images: list[np.ndarray], step: int | None = None) -> None:
        """Log ``images`` under ``key``.

        Args:
            key: the images' name in the run.
            images: the images' pixels.
            step: the step they are logged at.
        """

    def log_text(
        self, key: str, columns: list[str], data: list[list[Any]], step: int | None = None
    ) -> None:
        """Log a table of ``data`` under ``key``.

        Args:
            key: the table's name in the run.
            columns: the table's column names.
            data: its rows.
            step: the step it is logged at.
        """


@functools.cache
def lightning_types(name: str) -> tuple[type, ...]:
    """Return the class ``name`` from every installed Lightning and Fabric loggers namespace.

    An ``isinstance`` against one namespace's class silently misses the others'.

    Args:
        name: a logger class's name (``"CSVLogger"``).

    Returns:
        The class from each namespace that has it (Fabric's last: the Trainer's loggers
        subclass them).

    Example:
        >>> [t.__module__ for t in lightning_types("CSVLogger")][0]
        'pytorch_lightning.loggers.csv_logs'
    """
    found: list[type] = []
    for namespace in _NAMESPACES:
        try:
            found.append(getattr(importlib.import_module(namespace), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


class LoggerSink:
    """One Lightning logger as the library writes to it: one subclass per kind of logger.

    Every method gets host values and the optimizer step; what a logger cannot show keeps the
    default, which writes nothing (:meth:`scalars` and :meth:`save` call the logger's own). A
    subclass names the loggers it adapts in :meth:`accepts` and is registered with
    :func:`~lightning_hooks.logging.register_sink`.

    Attributes:
        logger: the Lightning logger written to.
        failed: whether the logger's client raised: nothing more is written to it.
        unsaved: whether something was written since the logger was last saved.
        shows_pictures: whether figures and images reach this logger.
    """

    shows_pictures: ClassVar[bool] = False

    def __init__(self, logger: LightningLogger) -> None:
        self.logger = logger
        self.failed = False
        self.unsaved = False

    @classmethod
    def accepts(cls, logger: object) -> bool:
        """Return whether this sink adapts ``logger``; the base adapts any logger (scalars only).

        Args:
            logger: one of the Trainer's loggers.

        Returns:
            Whether this kind of sink writes to it.
        """
        return True

    def scalars(self, metrics: Mapping[str, float], step: int) -> None:
        """Write ``metrics`` at ``step`` (the logger's own ``log_metrics``).

        Args:
            metrics: the scalars by tag.
            step: the optimizer step they are logged at.
        """
        self.logger.log_metrics(dict(metrics), step=step)

    def figure(self, tag: str, figure: Figure, step: int) -> None:
        """Write a matplotlib figure (the caller closes it).

        Args:
            tag: the figure's tag.
            figure: the figure to write.
            step: the optimizer step it is logged at.
        """

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        """Write a ``CHW`` CPU image tensor with values in ``[0, 1]``.

        Args:
            tag: the image's tag.
            image: the image, channels first.
            step: the optimizer step it is logged at.
        """

    def histogram(self, tag: str, binned: Binned, step: int) -> None:
        """Write a histogram binned on the device (see ``histogram_raw``).

        Args:
            tag: the histogram's tag.
            binned: the buckets' edges and counts, and the values' moments.
            step: the optimizer step it is logged at.
        """

    def text(self, tag: str, text: str, step: int) -> None:
        """Write Markdown ``text``.

        Args:
            tag: the text's tag.
            text: the Markdown to write.
            step: the optimizer step it is logged at.
        """

    def embedding(
        self, tag: str, features: torch.Tensor, labels: list[Any] | None, step: int
    ) -> None:
        """Write ``[N, D]`` features and their ``N`` labels for a projector.

        Args:
            tag: the embedding's tag.
            features: ``N`` points of ``D`` features each.
            labels: one label per point, or ``None``.
            step: the optimizer step it is logged at.
        """

    def has_new_charts(self) -> bool:
        """Return whether scalars were written under charts the last layout lacks.

        Returns:
            Whether a new layout is due; ``False`` for a logger without one.
        """
        return False

    def dashboard(self) -> None:
        """Write the layout of the charts of the scalars written so far, where one exists."""

    def save(self) -> None:
        """Persist what was written (the logger's own ``save``)."""
        self.logger.save()


def _figure_pixels(figure: Figure) -> np.ndarray:
    """Return the ``[H, W, 3]`` ``uint8`` RGB pixels of ``figure``, as TensorBoard renders it."""
    canvas = FigureCanvasAgg(figure)
    canvas.draw()  # type: ignore[no-untyped-call]
    return np.asarray(canvas.buffer_rgba())[:, :, :3].copy()  # type: ignore[no-untyped-call,no-any-return]


def _image_pixels(image: torch.Tensor) -> np.ndarray:
    """Return a ``CHW`` tensor in ``[0, 1]`` as ``uint8`` pixels, ``[H, W]`` or ``[H, W, C]``.

    Example:
        >>> import torch
        >>> _image_pixels(torch.tensor([[[0.0, 1.0]]])).tolist()
        [[0, 255]]
    """
    pixels = (image.detach().float().clamp(0, 1) * 255).round().byte().cpu().numpy()
    return pixels[0] if pixels.shape[0] == 1 else np.transpose(pixels, (1, 2, 0))


def _step_file(tag: str, step: int, suffix: str) -> str:
    """Return a file's path in the run, ``grad_flow/chart/step_000080.png``.

    One folder per tag, the step in the name.
    """
    return f"{tag}/step_{step:06d}{suffix}"


class CSVSink(LoggerSink):
    """Writes to a ``CSVLogger``: pictures as PNG files, text as Markdown files.

    Each figure or image goes to ``<log_dir>/<tag>/step_<step>.png``, every step's text to
    ``<log_dir>/<tag with dots>.md``; no histograms or embeddings.
    """

    shows_pictures: ClassVar[bool] = True
    logger: _CSVLogger

    @classmethod
    def accepts(cls, logger: object) -> bool:
        """Return whether ``logger`` is a ``CSVLogger``, of any namespace.

        Args:
            logger: one of the Trainer's loggers.

        Returns:
            Whether this sink adapts it.
        """
        return isinstance(logger, lightning_types("CSVLogger"))

    def _file(self, name: str) -> Path | None:
        """Return the path of ``name`` in the run's folder, its folder made.

        Args:
            name: the file's path under the run's ``log_dir``.

        Returns:
            The path; ``None`` on ranks > 0 (a dummy experiment).
        """
        log_dir = getattr(self.logger.experiment, "log_dir", None)
        if not isinstance(log_dir, str):
            return None
        path = Path(log_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def _write_png(self, tag: str, step: int, pixels: np.ndarray) -> None:
        """Save ``pixels`` as ``<log_dir>/<tag>/step_<step>.png`` (nothing on ranks > 0)."""
        from PIL import Image

        path = self._file(_step_file(tag, step, ".png"))
        if path is not None:
            Image.fromarray(pixels).save(path, format="PNG")

    def figure(self, tag: str, figure: Figure, step: int) -> None:
        """Save the figure as ``<log_dir>/<tag>/step_<step>.png``.

        Args:
            tag: the figure's tag, its folder.
            figure: the figure to save.
            step: the optimizer step, in the file's name.
        """
        self._write_png(tag, step, _figure_pixels(figure))

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        """Save the image as ``<log_dir>/<tag>/step_<step>.png``.

        Args:
            tag: the image's tag, its folder.
            image: a ``CHW`` image with values in ``[0, 1]``.
            step: the optimizer step, in the file's name.
        """
        self._write_png(tag, step, _image_pixels(image))

    def text(self, tag: str, text: str, step: int) -> None:
        """Append ``text`` under a step heading to ``<tag with dots>.md`` beside ``metrics.csv``.

        Args:
            tag: the text's tag, the file's name with dots for slashes.
            text: the Markdown to append.
            step: the optimizer step, in the heading.
        """
        path = self._file(tag.replace("/", ".") + ".md")
        if path is not None:
            with path.open("a", encoding="utf-8") as file:
                file.write(f"## {tag}, step {step}\n\n{text}\n\n")


_UNSAFE = re.compile(r"[^a-zA-Z0-9_/. -]+")


class MLflowSink(LoggerSink):
    """Writes to an ``MLFlowLogger``, through its ``MlflowClient``.

    Figures and text go as ``<tag>/step_<step>`` ``.png`` / ``.md`` artifacts, images as MLflow
    images; no histograms or embeddings.
    """

    shows_pictures: ClassVar[bool] = True
    logger: _MlflowLogger

    @classmethod
    def accepts(cls, logger: object) -> bool:
        """Return whether ``logger`` is an ``MLFlowLogger``, of any namespace.

        Args:
            logger: one of the Trainer's loggers.

        Returns:
            Whether this sink adapts it.
        """
        return isinstance(logger, lightning_types("MLFlowLogger"))

    def figure(self, tag: str, figure: Figure, step: int) -> None:
        """Store the figure as the run's artifact ``<tag>/step_<step>.png``.

        Args:
            tag: the figure's tag, the artifact's folder.
            figure: the figure to store.
            step: the optimizer step, in the artifact's name.
        """
        path = _step_file(tag, step, ".png")
        self.logger.experiment.log_figure(self.logger.run_id, figure, path)

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        """Store the image as an MLflow image.

        Args:
            tag: the image's tag, its key once cleaned to MLflow's metric-name rules.
            image: a ``CHW`` image with values in ``[0, 1]``.
            step: the optimizer step it is logged at.
        """
        # The key follows MLflow's metric-name rules, as Lightning's log_metrics cleans its keys.
        pixels = _image_pixels(image)
        key = _UNSAFE.sub("", tag)
        self.logger.experiment.log_image(self.logger.run_id, pixels, key=key, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        """Store the text as the run's artifact ``<tag>/step_<step>.md``.

        Args:
            tag: the text's tag, the artifact's folder.
            text: the Markdown to store.
            step: the optimizer step, in the artifact's name.
        """
        self.logger.experiment.log_text(self.logger.run_id, text, _step_file(tag, step, ".md"))


_MAX_BINS = 512  # wandb.Histogram refuses more


def _rebinned(counts: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge neighbouring buckets down to the 512 ``wandb`` takes at most.

    Args:
        counts: each bucket's count.
        edges: the buckets' edges, one more than the counts.

    Returns:
        The merged counts and their edges (the arguments themselves where they fit).

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
    """Writes to a ``WandbLogger``, at ``trainer/global_step`` as Lightning logs.

    Figures and images go as ``wandb.Image``, histograms as ``wandb.Histogram``, text as a table
    row; no embeddings.
    """

    shows_pictures: ClassVar[bool] = True
    logger: _WandbLogger

    @classmethod
    def accepts(cls, logger: object) -> bool:
        """Return whether ``logger`` is a ``WandbLogger``, of any namespace.

        Args:
            logger: one of the Trainer's loggers.

        Returns:
            Whether this sink adapts it.
        """
        return isinstance(logger, lightning_types("WandbLogger"))

    def figure(self, tag: str, figure: Figure, step: int) -> None:
        """Log the figure as a ``wandb.Image``.

        Args:
            tag: the figure's key.
            figure: the figure to log.
            step: the optimizer step it is logged at.
        """
        self.logger.log_image(key=tag, images=[_figure_pixels(figure)], step=step)

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        """Log the image as a ``wandb.Image``.

        Args:
            tag: the image's key.
            image: a ``CHW`` image with values in ``[0, 1]``.
            step: the optimizer step it is logged at.
        """
        self.logger.log_image(key=tag, images=[_image_pixels(image)], step=step)

    def histogram(self, tag: str, binned: Binned, step: int) -> None:
        """Log the histogram as a ``wandb.Histogram``, its buckets merged to 512 at most.

        Args:
            tag: the histogram's key.
            binned: the buckets' right edges and counts (the first bucket's left edge is one
                bucket's width below its right).
            step: the optimizer step it is logged at.
        """
        import wandb

        limits = binned.limits
        width = limits[1] - limits[0] if len(limits) > 1 else 1.0
        counts, edges = _rebinned(binned.counts, np.concatenate([[limits[0] - width], limits]))
        histogram = wandb.Histogram(np_histogram=(counts.tolist(), edges.tolist()))
        self.logger.experiment.log({tag: histogram, "trainer/global_step": step})

    def text(self, tag: str, text: str, step: int) -> None:
        """Log the text as a table row of ``step`` and ``text``.

        Args:
            tag: the table's key.
            text: the Markdown to log.
            step: the optimizer step, the row's first column.
        """
        self.logger.log_text(key=tag, columns=["step", "text"], data=[[step, text]], step=step)
