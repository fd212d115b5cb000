"""TensorBoard: its sink and the custom-scalars dashboard.

Scalar tags are ``<family>/<stat>/<layer>``, ``<family>/global/<stat>`` (``<stat>_p50``: a
percentile over layers), ``<family>/alarms/<rule>`` or ``<family>/notices/<name>``; a logging
step's tag has ``_step`` after its statistic (:func:`step_tag`, Lightning's convention).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
from matplotlib.figure import Figure
from typing_extensions import TypedDict, Unpack

from lightning_hooks.internals.tensorboard import fast_checksums, one_event_writer
from lightning_hooks.logging.sinks import (
    Binned,
    LightningLogger,
    LoggerSink,
    Moments,
    lightning_types,
)
from lightning_hooks.tags import (
    ACTIVATIONS,
    ALARMS,
    DEAD_RELU,
    GLOBAL,
    GRAD_FLOW,
    NOTICE_COUNTS,
    PERCENTILE,
    STEP,
    TAG_CACHE_SIZE,
    step_tag,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "MAX_CHARTS",
    "RawHistogram",
    "TensorBoardSink",
    "chart_key",
    "dashboard_layout",
    "histogram_raw",
    "step_tag",
]


class RawHistogram(TypedDict):
    """The keyword arguments of ``SummaryWriter.add_histogram_raw`` (:func:`histogram_raw`)."""

    min: float
    max: float
    num: float
    sum: float
    sum_squares: float
    bucket_limits: list[float]
    bucket_counts: list[float]


class _PictureWriter(Protocol):
    """The calls of a ``SummaryWriter`` that write pictures: figures, images and histograms."""

    def add_figure(self, tag: str, figure: Figure, global_step: int, close: bool) -> None:
        """Write ``figure`` as an image.

        Args:
            tag: the image's tag.
            figure: the figure to draw.
            global_step: the step it is logged at.
            close: whether the writer closes the figure.
        """

    def add_image(
        self, tag: str, img_tensor: torch.Tensor, global_step: int, dataformats: str
    ) -> None:
        """Write an image.

        Args:
            tag: the image's tag.
            img_tensor: the image's pixels.
            global_step: the step it is logged at.
            dataformats: the order of the image's dimensions (``"CHW"``).
        """

    def add_histogram_raw(self, tag: str, global_step: int, **raw: Unpack[RawHistogram]) -> None:
        """Write pre-binned counts.

        Args:
            tag: the histogram's tag.
            global_step: the step it is logged at.
            **raw: the buckets and moments (the keywords of :func:`histogram_raw`).
        """


class _SummaryWriter(_PictureWriter, Protocol):
    """The calls of a ``SummaryWriter`` that :class:`TensorBoardSink` makes.

    Beside the pictures', these write text, embeddings and the custom-scalars layout.
    """

    def add_text(self, tag: str, text_string: str, global_step: int) -> None:
        """Write Markdown text.

        Args:
            tag: the text's tag.
            text_string: the Markdown to write.
            global_step: the step it is logged at.
        """

    def add_embedding(
        self, mat: torch.Tensor, metadata: list[Any] | None, global_step: int, tag: str
    ) -> None:
        """Write features for the projector.

        Args:
            mat: the points' features, one row per point.
            metadata: one label per point, or ``None``.
            global_step: the step it is logged at.
            tag: the embedding's tag.
        """

    def add_custom_scalars(self, layout: dict[str, dict[str, list[Any]]]) -> None:
        """Write the custom-scalars layout.

        Args:
            layout: the charts by category and title (see :func:`dashboard_layout`).
        """


class _TensorBoardLogger(LightningLogger, Protocol):
    """A ``TensorBoardLogger``: its ``SummaryWriter``."""

    @property
    def experiment(self) -> _SummaryWriter:
        """The writer (a dummy one on ranks > 0)."""


class TensorBoardSink(LoggerSink):
    """Writes to a ``TensorBoardLogger`` (either namespace, or a subclass).

    Its ``SummaryWriter`` gets figures, images, histograms, text, embeddings and the
    custom-scalars layout.

    Args:
        logger: the ``TensorBoardLogger`` written to.
    """

    shows_pictures: ClassVar[bool] = True
    logger: _TensorBoardLogger

    def __init__(self, logger: LightningLogger) -> None:
        super().__init__(logger)
        self.charts: set[tuple[str, str]] = set()
        """The ``(family, stat)`` charts of the scalars written so far (:func:`chart_key`)."""
        self.charts_written: frozenset[tuple[str, str]] = frozenset()
        """The charts of the last layout written."""
        fast_checksums(self.logger.experiment)  # a speed-up: this writer's checksums in C

    @classmethod
    def accepts(cls, logger: object) -> bool:
        """Return whether ``logger`` is a ``TensorBoardLogger`` (either namespace, or a subclass).

        Args:
            logger: one of the Trainer's loggers.

        Returns:
            Whether this sink adapts it.
        """
        return isinstance(logger, lightning_types("TensorBoardLogger"))

    def scalars(self, metrics: Mapping[str, float], step: int) -> None:
        """Write ``metrics`` at ``step``, as one event where the speed-up applies.

        A plain ``TensorBoardLogger`` gets the values as one event where the speed-up applies
        (:func:`~lightning_hooks.internals.tensorboard.one_event_writer`); any other (a subclass
        may log otherwise) gets the logger's own ``log_metrics``. Their charts go into the
        writer's layout.

        Args:
            metrics: the scalars by tag.
            step: the optimizer step they are logged at.
        """
        plain = type(self.logger) in lightning_types("TensorBoardLogger")
        write = one_event_writer(self.logger) if plain else None
        if write is None:
            self.logger.log_metrics(dict(metrics), step=step)
        else:
            write(metrics, step)
        self.charts.update(_charts(tuple(metrics)))  # their charts go into the writer's layout

    def figure(self, tag: str, figure: Figure, step: int) -> None:
        """Write the figure as an image (left open: the caller closes it).

        Args:
            tag: the image's tag.
            figure: the figure to draw.
            step: the optimizer step it is logged at.
        """
        self.logger.experiment.add_figure(tag, figure, global_step=step, close=False)

    def image(self, tag: str, image: torch.Tensor, step: int) -> None:
        """Write a ``CHW`` image.

        Args:
            tag: the image's tag.
            image: the image, channels first, with values in ``[0, 1]``.
            step: the optimizer step it is logged at.
        """
        self.logger.experiment.add_image(tag, image, global_step=step, dataformats="CHW")

    def histogram(self, tag: str, binned: Binned, step: int) -> None:
        """Write a histogram binned on the device, as ``add_histogram_raw``'s pre-binned counts.

        Args:
            tag: the histogram's tag.
            binned: the buckets' right edges and counts, and the values' moments.
            step: the optimizer step it is logged at.
        """
        raw = histogram_raw(*binned)
        self.logger.experiment.add_histogram_raw(tag, global_step=step, **raw)

    def text(self, tag: str, text: str, step: int) -> None:
        """Write Markdown text (TensorBoard files it under ``<tag>/text_summary``).

        Args:
            tag: the text's tag.
            text: the Markdown to write.
            step: the optimizer step it is logged at.
        """
        self.logger.experiment.add_text(tag, text, global_step=step)

    def embedding(
        self, tag: str, features: torch.Tensor, labels: list[Any] | None, step: int
    ) -> None:
        """Write features and their labels for TensorBoard's projector.

        Args:
            tag: the embedding's tag.
            features: ``N`` points of ``D`` features each.
            labels: one label per point, or ``None``.
            step: the optimizer step it is logged at.
        """
        self.logger.experiment.add_embedding(features, metadata=labels, global_step=step, tag=tag)

    def has_new_charts(self) -> bool:
        """Return whether scalars were written under charts the last layout lacks.

        Returns:
            Whether a new layout is due (the charts only grow).
        """
        return len(self.charts) > len(self.charts_written)

    def dashboard(self) -> None:
        """Write the writer's layout of every chart so far (TensorBoard reads the last one)."""
        keys = frozenset(self.charts)
        self.logger.experiment.add_custom_scalars(dashboard_layout(keys))
        self.charts_written = keys


def histogram_raw(
    limits: np.ndarray, counts: np.ndarray, moments: Moments | None = None
) -> RawHistogram:
    """Return the keyword arguments of ``SummaryWriter.add_histogram_raw`` for pre-binned counts.

    Args:
        limits: ``[buckets]`` right edges of the buckets.
        counts: ``[buckets]`` counts.
        moments: ``(min, max, sum, sum of squares)`` of the values binned; ``None``: from the
            bucket centres (the first bucket as wide as the second), the filled buckets' span.

    Returns:
        The bucket limits and counts, the values' count, and the moments.

    Example:
        >>> raw = histogram_raw(np.array([0.0, 1.0, 2.0]), np.array([0.0, 2.0, 1.0]))
        >>> raw["min"], raw["max"], raw["num"], raw["sum"]
        (0.0, 2.0, 3.0, 2.5)
    """
    if moments is None:
        lower = np.concatenate([[limits[0] - (limits[1] - limits[0])], limits[:-1]])
        centres = (lower + limits) / 2
        filled = np.flatnonzero(counts)
        moments = (
            float(lower[filled[0]]) if filled.size else 0.0,
            float(limits[filled[-1]]) if filled.size else 0.0,
            float((centres * counts).sum()),
            float((centres**2 * counts).sum()),
        )
    low, high, total, sum_sq = moments
    return RawHistogram(
        min=low,
        max=high,
        num=float(counts.sum()),
        sum=total,
        sum_squares=sum_sq,
        bucket_limits=[float(e) for e in limits],
        bucket_counts=[float(c) for c in counts],
    )


MAX_CHARTS = 64
"""At most this many charts in one run's layout; the families' own tags beyond it are dropped."""

_CATEGORY_ORDER = (GRAD_FLOW, ALARMS, NOTICE_COUNTS, ACTIVATIONS, DEAD_RELU)
_COUNTS = ("alarms", "notices")  # a chart per family, never per layer: one line per rule
# Within a category: the statistics a reader looks at first (the rest by name).
_CHART_ORDER = (
    *("attn_logit_max", "attn_entropy_min"),
    *("grad_norm", "output_grad_norm", "update_ratio", "grad_abs_mean", "grad_nonfinite"),
    *("dead_fraction", "zero_fraction", "abs_mean", "std", "mean"),
)


@functools.lru_cache(maxsize=64)
def _charts(tags: tuple[str, ...]) -> frozenset[tuple[str, str]]:
    """Return the charts of a sequence of tags (:func:`chart_key`).

    Cached: a logging step writes the same tags.
    """
    return frozenset(key for key in map(chart_key, tags) if key is not None)


@functools.lru_cache(maxsize=TAG_CACHE_SIZE)
def chart_key(tag: str) -> tuple[str, str] | None:
    """Return the ``(family, stat)`` chart a tag belongs to.

    Args:
        tag: a scalar's tag.

    Returns:
        The chart's family and statistic (a percentile's ``_p50`` dropped), or ``None`` for a
        tag outside the scheme.

    Example:
        >>> chart_key("grad_flow/grad_norm/encoder.0"), chart_key("grad_flow/global/grad_norm_p50")
        (('grad_flow', 'grad_norm'), ('grad_flow', 'grad_norm'))
        >>> chart_key("train/loss") is None
        True
    """
    parts = tag.split("/")
    if len(parts) < 3 or not all(parts):
        return None
    if parts[1] == GLOBAL:
        return parts[0], PERCENTILE.sub("", parts[2])
    return parts[0], parts[1]


def dashboard_layout(keys: Iterable[tuple[str, str]]) -> dict[str, dict[str, list[Any]]]:
    """Return the custom-scalars layout of the given charts, for ``add_custom_scalars``.

    The layout is for ``SummaryWriter.add_custom_scalars``: one multiline chart per
    ``(family, stat)`` in its family's category, one per family's alarms in ``alarms`` and per
    family's notices in ``notices``; at most :data:`MAX_CHARTS` charts, the most read first.

    Args:
        keys: the charts, as :func:`chart_key` gives them (repeats are ignored).

    Returns:
        The charts by category title (``"lightning_hooks: <category>"``) and chart title, each
        ``["Multiline", regexes]``.

    Example:
        >>> keys = [("dead_relu", "dead_fraction"), ("grad_flow", "update_ratio"),
        ...         ("grad_flow", "alarms"), ("activations", "std"), ("grad_flow", "grad_norm")]
        >>> layout = dashboard_layout(keys)
        >>> [(title.split(": ")[1], list(charts)) for title, charts in layout.items()]
        ... # doctest: +NORMALIZE_WHITESPACE
        [('grad_flow', ['grad_norm', 'update_ratio']), ('alarms', ['grad_flow']),
         ('activations', ['std']), ('dead_relu', ['dead_fraction'])]
        >>> kind, (per_layer, overall) = layout["lightning_hooks: grad_flow"]["grad_norm"]
        >>> kind, per_layer, bool(re.match(overall, "grad_flow/global/grad_norm_p50"))
        ('Multiline', '^grad_flow/grad_norm/.*', True)
    """
    layout: dict[str, dict[str, list[Any]]] = {}
    for family, stat in sorted(set(keys), key=_chart_rank)[:MAX_CHARTS]:
        regexes = [f"^{re.escape(family)}/{re.escape(stat)}/.*"]
        base = stat.removesuffix(STEP)
        if base in _COUNTS:  # chart grad_flow or grad_flow_step
            category = base
            chart = family + stat.removeprefix(base)
        else:
            category = family
            chart = stat
            regexes.append(f"^{re.escape(family)}/global/{re.escape(stat)}(_p\\d+)?$")
        layout.setdefault(f"lightning_hooks: {category}", {})[chart] = ["Multiline", regexes]
    return layout


def _chart_rank(key: tuple[str, str]) -> tuple[int, str, int, str]:
    """Return the sort key of a chart: its category's rank, the statistic's, its step chart last."""
    family, stat = key
    base = stat.removesuffix(STEP)
    category = base if base in _COUNTS else family
    first = _CATEGORY_ORDER.index(category) if category in _CATEGORY_ORDER else len(_CATEGORY_ORDER)
    within = _CHART_ORDER.index(base) if base in _CHART_ORDER else len(_CHART_ORDER)
    return first, category, within, f"{family}/{base}/{stat != base:d}"
