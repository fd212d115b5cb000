"""The ``ActivationStatsCallback``: statistics of each layer's output, logged at each epoch end."""

from __future__ import annotations

from typing import Any

import numpy as np
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.attached import Logged, epoch_step
from lightning_hooks.callbacks.base import HookCallback
from lightning_hooks.callbacks.epoch_columns import EpochColumns
from lightning_hooks.callbacks.trainer import TrainerView
from lightning_hooks.callbacks.watching import attach_stats, watches_selection
from lightning_hooks.core.checks import boolean, named_arguments, positive_int, real
from lightning_hooks.core.hooks.guard import guarded
from lightning_hooks.core.hooks.selection import ModuleTypes, Patterns, Selection
from lightning_hooks.core.stats.activation_shape import ActivationShape
from lightning_hooks.core.stats.activation_stats import ActivationResult, ActivationStatsTracker
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.logging import Binned, layer_epoch_heatmap, log_figure, log_histogram
from lightning_hooks.tags import ACTIVATIONS, family_tag

__all__ = ["ActivationStatsCallback"]

_HEATMAPS = ("mean", "std", "zero_fraction")


@named_arguments
class ActivationStatsCallback(HookCallback):
    r"""Logs per-layer statistics of every selected module's output at each epoch end.

    The statistics are over the epoch's logging steps' training forwards; each logging step
    also logs them under ``activations/{stat}_step/...``.

    Logged metrics (``{layer}`` is the module's qualified name; a tuple / list / dict output adds
    ``.{index}`` or ``.{key}``, e.g. ``lstm.0``):

    ======================================  ===================================================
    Tag                                     Value, over the epoch's training outputs
    ======================================  ===================================================
    ``activations/mean/{layer}``            mean of all elements
    ``activations/std/{layer}``             standard deviation (Bessel-corrected)
    ``activations/min/{layer}``             smallest element
    ``activations/max/{layer}``             largest element
    ``activations/abs_mean/{layer}``        mean ``|x|``
    ``activations/zero_fraction/{layer}``   fraction of elements exactly ``0``
    ``activations/nonfinite/{layer}``       number of NaN / Inf elements
    ``activations/kurtosis/{layer}``        Pearson's kurtosis, population moments
    ``activations/outlier_ratio/{layer}``   ``max |x|`` over the root mean square of ``x``
    ``activations/histogram/{layer}``       histogram (``histograms=True``; TensorBoard, W&B)
    ``activations/heatmap/{stat}`` (image)  layer x epoch of ``mean``, ``std``, ``zero_fraction``
    ======================================  ===================================================

    Args:
        types: only modules of these types (default: parameter-owning and activation modules).
        include: glob patterns on qualified module names (``"encoder.*"``) to keep.
        exclude: glob patterns on qualified module names to drop.
        histograms: log a histogram per layer each epoch.
        histogram_bins: number of bins of each layer's histogram.
        histogram_range: fixed ``(low, high)`` bin edges; ``None``: each layer's min and max of
            the previous epoch (or its first output).
        heatmaps: log the layer x epoch heatmap images.
        warn_nonfinite: warn when an output goes NaN / Inf.
        fused: compile the statistics with ``torch.compile`` into one pass per output instead
            of six (needs a C++ compiler on CPU; cheaper for large outputs).
        every_n_steps: measure optimizer steps ``n-1, 2n-1, ...`` and each epoch's first
            (``None``: the Trainer's ``log_every_n_steps``; 1: every step).

    Example:
        >>> import pytorch_lightning as pl
        >>> callback = ActivationStatsCallback(exclude="head", histograms=True)
        >>> trainer = pl.Trainer(callbacks=[callback])  # doctest: +SKIP
    """

    def __init__(  # noqa: PLR0913 (a callback's public constructor: one keyword per option)
        self,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        histograms: bool = False,
        histogram_bins: int = 64,
        histogram_range: tuple[float, float] | None = None,
        heatmaps: bool = True,
        warn_nonfinite: bool = True,
        fused: bool = False,
        every_n_steps: int | None = None,
    ) -> None:
        owner = type(self).__name__  # a subclass's own name, as the lifecycle's messages give
        selection = Selection.of(owner, types=types, include=include, exclude=exclude)
        self.histogram_bins = positive_int(owner, "histogram_bins", histogram_bins)
        self.histogram_range = _check_range(histogram_range, owner)
        self.histograms = boolean(owner, "histograms", histograms)
        self.heatmaps = boolean(owner, "heatmaps", heatmaps)
        self.warn_nonfinite = boolean(owner, "warn_nonfinite", warn_nonfinite)
        self.fused = boolean(owner, "fused", fused)
        tracker = ActivationStatsTracker(
            types=selection.types,
            include=selection.include,
            exclude=selection.exclude,
            histogram_bins=self.histogram_bins if self.histograms else 0,
            histogram_range=self.histogram_range,
            fused=self.fused,
            owner=owner,
        )
        shape = ActivationShape(
            types=selection.types,
            include=selection.include,
            exclude=selection.exclude,
            owner=owner,
        )
        super().__init__(
            state_key={"stats": [tracker.config_key(), shape.config_key()]},
            every_n_steps=every_n_steps,
            uses_images=self.heatmaps or self.histograms,
        )
        self.types = types
        self.include = selection.include
        self.exclude = selection.exclude
        self._history = EpochColumns()  # the heatmaps' columns, one per epoch of the fit
        # So that a resumed fit draws the earlier epochs.
        self.lifecycle.checkpoint.keep("heatmaps", self._history)
        self._activations = tracker
        self._shape = shape

    @override
    def on_fit_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Check that the selection finds some module of the model."""
        if self.lifecycle.watching:
            stats: list[LayerStat[Any]] = [self._activations, self._shape]
            selected = {"types": self.types, "include": self.include, "exclude": self.exclude}
            self.lifecycle.watching = watches_selection(
                self.lifecycle.owner, pl_module, stats, what="module", selected=selected
            )

    @override
    @guarded
    def on_train_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Hook the statistics on the selected modules; each epoch's go to :meth:`_draw`."""
        if self.lifecycle.start_training():
            self._history.clear()  # a new fit's heatmaps; lifecycle.attach loads a checkpoint's
            logged: list[Logged[Any]] = [
                Logged(self._activations, on_epoch=self._draw),
                Logged(self._shape),
            ]
            self.lifecycle.attach(attach_stats(pl_module, self.hook_guard(), logged))

    @override
    @guarded
    def on_train_batch_start(
        self, trainer: TrainerView, pl_module: nn.Module, batch: Any, batch_idx: int
    ) -> None:
        """Put the module hooks on the model if the batch belongs to a logging step."""
        self.lifecycle.start_batch(trainer, batch_idx)

    @override
    @guarded
    def on_train_batch_end(
        self,
        trainer: TrainerView,
        pl_module: nn.Module,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Warn of the first non-finite output, then log a logging step whose optimizer step ran."""
        if self.lifecycle.measuring and self.warn_nonfinite:
            self._warn_first_nonfinite()
        self.lifecycle.end_batch(trainer)

    @override
    @guarded
    def on_train_epoch_end(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Log the epoch's aggregates; :meth:`_draw` then draws the histograms and heatmaps."""
        self.lifecycle.end_epoch(trainer)

    def _warn_first_nonfinite(self) -> None:
        """Warn once of the first module whose output went non-finite, in a measured batch.

        The tracker watches for it afresh in each fit, from the moment it attaches.
        """
        found = self._activations.take_first_nonfinite(self.lifecycle.batch_step)
        if found is not None:
            step, module = found
            rank_zero_warn(
                f"{self.lifecycle.owner}: the first module whose output went non-finite (NaN/Inf) "
                f"is '{module}', at global step {step} (the first in execution order "
                "in the first step with a non-finite output).",
                category=LightningHooksWarning,
            )

    def _draw(self, trainer: TrainerView, result: ActivationResult) -> None:
        """Log the epoch's histograms and heatmaps, on rank 0.

        The heatmaps' columns are kept whether or not ``heatmaps`` draws them.

        Args:
            trainer: the trainer whose loggers are written to, at the epoch's step
                (:func:`~.attached.epoch_step`); its epoch names the heatmaps' new column.
            result: the epoch's statistics per layer and their histograms.
        """
        stats = result.summary
        hists = result.histograms
        if not stats.layers or not trainer.is_global_zero:
            return
        step = epoch_step(trainer)
        columns = (stats.min, stats.max, stats.sum, stats.sum_sq)  # the histograms' moments
        for row, hist in enumerate(hists):
            if stats.numel[row] and np.isfinite(hist.edges).all():
                low, high, total, squares = (float(column[row]) for column in columns)
                binned = Binned(hist.edges[1:], hist.counts, (low, high, total, squares))
                tag = family_tag(ACTIVATIONS, "histogram", hist.layer)
                log_histogram(trainer.loggers, tag, binned, step)
        heatmaps = {stat: stats.column(stat) for stat in _HEATMAPS}
        self._history.add(trainer.current_epoch, stats.layers, heatmaps)
        if self.heatmaps:
            self._log_heatmaps(trainer, step)

    def _log_heatmaps(self, trainer: TrainerView, step: int) -> None:
        """Draw the layer by epoch heatmap of each statistic in the kept columns.

        Args:
            trainer: the trainer whose loggers get the figures.
            step: the step the figures are logged at.
        """
        for stat in _HEATMAPS:
            layers, epochs, grid = self._history.grid(stat)
            figure = layer_epoch_heatmap(layers, epochs, grid, title=f"activations: {stat}")
            log_figure(trainer.loggers, family_tag(ACTIVATIONS, "heatmap", stat), figure, step)


def _check_range(value: tuple[float, float] | None, owner: str) -> tuple[float, float] | None:
    """Check ``histogram_range``: ``None`` or a ``(low, high)`` pair with ``low < high``.

    Args:
        value: the range the user gave.
        owner: the callback whose argument it is, which the error names.

    Returns:
        The range as two floats, or ``None``.

    Raises:
        ValueError: ``value`` is neither ``None`` nor such a pair.
    """
    if value is None:
        return None
    if isinstance(value, tuple | list) and len(value) == 2:
        low = real(owner, "histogram_range[0]", value[0])
        high = real(owner, "histogram_range[1]", value[1])
        if low < high:
            return low, high
    expected = "None or (low, high) with low < high"
    raise ValueError(f"{owner}(histogram_range={value!r}): must be {expected}, got {value!r}")
