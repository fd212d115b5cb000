"""``GradFlowCallback``: how gradients flow through every layer, logged at each epoch end."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from typing_extensions import override

from lightning_hooks.callbacks._base import HookCallback
from lightning_hooks.core import (
    GradFlowTracker,
    LayerHistogram,
    LayerHistograms,
    LayerStats,
    select_modules,
)
from lightning_hooks.core.selection import ModuleTypes, Patterns, as_patterns
from lightning_hooks.logging import (
    grad_flow_figure,
    layer_epoch_heatmap,
    log_figure,
    log_histogram_raw,
    log_scalars,
)

__all__ = ["GradFlowCallback"]

# (tag suffix, statistic, reduction over the epoch's optimizer steps)
_LOGGED: tuple[tuple[str, str, str], ...] = (
    ("grad_norm", "grad_norm", "mean"),
    ("grad_norm_max", "grad_norm", "peak"),
    ("grad_abs_mean", "grad_abs_mean", "mean"),
    ("grad_abs_max", "grad_abs_max", "peak"),
    ("grad_nonfinite", "grad_nonfinite", "total"),
    ("weight_norm", "weight_norm", "mean"),
    ("update_ratio", "update_ratio", "mean"),
    ("update_ratio_max", "update_ratio", "peak"),
    ("output_grad_norm", "output_grad_norm", "mean"),
    ("output_grad_norm_max", "output_grad_norm", "peak"),
)


def _check_types(types: ModuleTypes) -> None:
    items = types if isinstance(types, tuple) else (types,)
    for t in items:
        if t is not None and not (isinstance(t, type) and issubclass(t, torch.nn.Module)):
            raise TypeError(
                f"GradFlowCallback(types={types!r}): expected an nn.Module subclass or a tuple "
                f"of them, got {t!r}"
            )


class GradFlowCallback(HookCallback):
    r"""Per-layer gradient flow: the gradient the optimizer applies, weights, updates.

    A *layer* is a module owning trainable parameters directly (a ``Linear``, a ``Conv2d``, a
    ``BatchNorm``); its parameters are measured together. At every optimizer step, on the device
    and without a host sync, it measures the gradient the optimizer applies (in
    ``on_before_optimizer_step``: accumulated over ``accumulate_grad_batches``, all-reduced under
    DDP, unscaled under AMP), the weights, the update the step makes, and the gradient with
    respect to each layer's output (a tensor hook on the output, which works with
    ``ReLU(inplace=True)``). At each epoch end the mean and max over the epoch's optimizer steps
    are reduced across ranks, copied to the host once and logged at ``trainer.global_step``.

    Logged metrics (``{layer}`` is the module's qualified name, e.g. ``encoder.0``):

    ==========================================  ================================================
    Tag                                         Value, over the epoch's optimizer steps
    ==========================================  ================================================
    ``grad_flow/grad_norm/{layer}``             L2 norm of the layer's gradient, mean
    ``grad_flow/grad_norm_max/{layer}``         L2 norm of the layer's gradient, max
    ``grad_flow/grad_abs_mean/{layer}``         mean ``|g|`` over the layer's entries, mean
    ``grad_flow/grad_abs_max/{layer}``          max ``|g|`` over the layer's entries, max
    ``grad_flow/grad_nonfinite/{layer}``        NaN/Inf gradient entries, total
    ``grad_flow/weight_norm/{layer}``           L2 norm of the weights before the step, mean
    ``grad_flow/update_ratio/{layer}``          ``||w_after - w_before|| / ||w_before||``, mean
    ``grad_flow/update_ratio_max/{layer}``      the same, max
    ``grad_flow/output_grad_norm/{layer}``      L2 norm of d loss / d output, mean
    ``grad_flow/output_grad_norm_max/{layer}``  the same, max
    ``grad_flow/global/{stat}``                 the first eight, over all layers together
    ``grad_flow/global/{stat}_p{q}``            beyond ``max_layers_logged`` layers only: the
                                                5th, 50th, 95th percentile over layers
    ``grad_flow/chart`` (image)                 mean and max ``|g|`` per layer, log scale
    ``grad_flow/heatmap`` (image)               with ``heatmap=True``: gradient norm per
                                                layer x epoch, log scale
    ``grad_flow/grad_log10_abs/{layer}``        with ``histograms=True``: histogram of
    (histogram)                                 ``log10 |g|`` over the epoch's steps
    ==========================================  ================================================

    Bounded for deep models: with more than ``max_layers_logged`` layers, an epoch logs the
    per-layer tags of that many layers only (the layers with a non-finite gradient first, then
    half with the largest and half with the smallest gradient norm of the epoch, so the set may
    change between epochs) plus the percentiles over all layers. The chart always shows every
    layer, in a figure of bounded size.

    The output-gradient norm of a step sums squares over its micro-batches and over every call of
    a module called more than once. A step that is skipped (AMP overflow) measures gradients but
    no update. Scalars go to every logger of the Trainer; the chart needs a ``TensorBoardLogger``.

    Args:
        types: only modules of these types count as layers (default: any module with parameters).
        include: glob patterns on qualified module names (``"encoder.*"``) to keep.
        exclude: glob patterns on qualified module names to drop.
        update_ratio: measure the update-to-weight ratio (keeps one copy of the parameters).
        output_grad: measure the gradient with respect to each layer's output.
        chart: log the gradient-flow chart image each epoch.
        max_layers_logged: per-layer tags for at most this many layers per epoch (``None``: all).
        histograms: log a histogram of ``log10 |g|`` per layer each epoch (fixed half-decade
            buckets from 1e-12 to 1e4, counted on the device: one more pass over the gradients
            per step).
        heatmap: log an image of the gradient norm per layer (rows) and epoch (columns) each
            epoch (the history is kept on the host: one float per layer and epoch).

    Example:
        >>> import pytorch_lightning as pl
        >>> trainer = pl.Trainer(callbacks=[GradFlowCallback(exclude="*.bn*")])  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        update_ratio: bool = True,
        output_grad: bool = True,
        chart: bool = True,
        max_layers_logged: int | None = 100,
        histograms: bool = False,
        heatmap: bool = False,
    ) -> None:
        _check_types(types)
        if max_layers_logged is not None and (
            isinstance(max_layers_logged, bool)
            or not isinstance(max_layers_logged, int)
            or max_layers_logged < 1
        ):
            raise ValueError(
                "GradFlowCallback(max_layers_logged=...): must be a positive int or None, "
                f"got {max_layers_logged!r}"
            )
        self.max_layers_logged = max_layers_logged
        self.histograms = histograms
        self._hist: LayerHistograms | None = None
        self._history: list[tuple[int, np.ndarray]] = []
        self.types = types
        self.include = as_patterns(include, "GradFlowCallback(include=...)")
        self.exclude = as_patterns(exclude, "GradFlowCallback(exclude=...)")
        self.update_ratio = update_ratio
        self.output_grad = output_grad
        self.chart = chart
        self.heatmap = heatmap
        self.uses_images = chart or heatmap
        self._tracker: GradFlowTracker | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(
            types=repr(self.types), include=self.include, exclude=self.exclude
        )

    @override
    def _validate(self, pl_module: pl.LightningModule) -> None:
        select_modules(pl_module, types=self.types, include=self.include, exclude=self.exclude)

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._tracker = GradFlowTracker(
            pl_module,
            trainer.optimizers,
            types=self.types,
            include=self.include,
            exclude=self.exclude,
            update_ratio=self.update_ratio,
            output_grad=self.output_grad,
        )
        self._history = []
        if self.histograms:
            layout = self._tracker.layout
            self._hist = LayerHistograms(len(layout.layers), device=layout.index.device)

    @override
    def _detach(self) -> None:
        if self._tracker is not None:
            self._tracker.remove()
            self._tracker = None
        self._hist = None

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._tracker is not None:
            self._tracker.observe(optimizer, _grad_scale(trainer))
        if self._hist is not None and self._tracker is not None:
            stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
            layout = self._tracker.layout
            pairs = [
                (p.grad, row)
                for p, row in zip(layout.params, layout.owner, strict=True)
                if p.grad is not None and id(p) in stepped
            ]
            self._hist.update([g for g, _ in pairs], [row for _, row in pairs])

    @override
    def _log_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._tracker is None:
            return
        stats = self._tracker.result()
        self._tracker.reset()
        if not stats.count.any():
            return
        step = trainer.global_step
        log_scalars(trainer.loggers, dict(_scalars(stats, self.max_layers_logged)), step)
        if self._hist is not None:
            self._log_histograms(trainer, self._hist, stats, step)
        if self.chart and trainer.is_global_zero:
            layers = stats.layers[:-1]
            figure = grad_flow_figure(
                layers,
                stats.column("grad_abs_mean")[:-1],
                stats.column("grad_abs_max", "peak")[:-1],
                title=f"gradient flow, epoch {trainer.current_epoch}",
            )
            log_figure(trainer.loggers, "grad_flow/chart", figure, step)
        if self.heatmap and trainer.is_global_zero:
            self._log_heatmap(trainer, stats, step)

    def _log_heatmap(self, trainer: pl.Trainer, stats: LayerStats, step: int) -> None:
        layers, epoch = stats.layers[:-1], trainer.current_epoch
        self._history.append((epoch, stats.column("grad_norm")[:-1].copy()))
        epochs = [e for e, _ in self._history]
        values = np.stack([v for _, v in self._history], axis=1)
        title = "gradient norm per layer and epoch (mean over steps)"
        heatmap = layer_epoch_heatmap(layers, epochs, values, title=title)
        log_figure(trainer.loggers, "grad_flow/heatmap", heatmap, step)

    def _log_histograms(
        self, trainer: pl.Trainer, hist: LayerHistograms, stats: LayerStats, step: int
    ) -> None:
        # Gradients are all-reduced before the optimizer step: rank 0's counts are every rank's.
        counts, limits = hist.host_counts(), hist.limits()
        hist.reset()
        if not trainer.is_global_zero:
            return
        for row in _logged_rows(stats, self.max_layers_logged):
            if counts[row].any():
                raw = LayerHistogram(limits, counts[row]).raw()
                tag = f"grad_flow/grad_log10_abs/{stats.layers[row]}"
                log_histogram_raw(trainer.loggers, tag, raw, step)


_PERCENTILES = (5, 50, 95)


def _scalars(stats: LayerStats, max_layers: int | None = None) -> Iterator[tuple[str, float]]:
    last = len(stats.layers) - 1  # the global row
    rows = _logged_rows(stats, max_layers)
    for suffix, stat, kind in _LOGGED:
        column = stats.column(stat, kind)
        counts = stats.count[:, stats.stats.index(stat)]
        for row in (*rows, last):
            if counts[row] == 0:
                continue
            layer = stats.layers[row]
            tag = f"grad_flow/global/{suffix}" if row == last else f"grad_flow/{suffix}/{layer}"
            yield tag, float(column[row])
        if len(rows) < last:
            yield from _percentiles(suffix, column[:last][counts[:last] > 0])


def _logged_rows(stats: LayerStats, max_layers: int | None) -> list[int]:
    """Layer rows to log: all, or non-finite first, then the largest and smallest grad norms."""
    num_layers = len(stats.layers) - 1
    if max_layers is None or num_layers <= max_layers:
        return list(range(num_layers))
    norm = stats.column("grad_norm")[:num_layers]
    nonfinite = stats.column("grad_nonfinite", "total")[:num_layers]
    bad = [int(i) for i in np.flatnonzero((nonfinite > 0) | ~np.isfinite(norm))][:max_layers]
    order = [int(i) for i in np.argsort(np.where(np.isfinite(norm), norm, np.inf)) if i not in bad]
    top = (max_layers - len(bad)) // 2
    smallest = order[: max_layers - len(bad) - top]
    largest = order[len(order) - top :] if top else []
    return sorted({*bad, *smallest, *largest})


def _percentiles(suffix: str, values: np.ndarray) -> Iterator[tuple[str, float]]:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return
    for q, value in zip(_PERCENTILES, np.percentile(values, _PERCENTILES), strict=True):
        yield f"grad_flow/global/{suffix}_p{q:02d}", float(value)


def _grad_scale(trainer: pl.Trainer) -> torch.Tensor | None:
    """The AMP GradScaler's scale as a device tensor (no sync), or ``None`` without AMP."""
    scaler: Any = getattr(trainer.strategy.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None
