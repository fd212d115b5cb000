"""The chart, heatmap and histograms that ``GradFlowCallback`` logs at each epoch end."""

from __future__ import annotations

import torch

from lightning_hooks.callbacks.attached import epoch_step
from lightning_hooks.callbacks.epoch_columns import EpochColumns
from lightning_hooks.callbacks.trainer import TrainerView
from lightning_hooks.core import LayerHistograms, LayerTable, ParamLayout
from lightning_hooks.core.sharding import ShardPlan
from lightning_hooks.core.stats.grad_flow import logged_rows
from lightning_hooks.logging import (
    Binned,
    grad_flow_figure,
    layer_epoch_heatmap,
    log_figure,
    log_histogram,
)
from lightning_hooks.tags import GRAD_FLOW, family_tag, grad_flow_tag

__all__ = ["GradFlowPictures", "observe_histograms"]


def observe_histograms(
    hist: LayerHistograms,
    layout: ParamLayout,
    optimizer: torch.optim.Optimizer,
    param_grad_scale: torch.Tensor | None = None,
) -> None:
    """Add the gradients ``optimizer`` is about to apply to ``hist``, per layer of ``layout``.

    Only the parameters ``optimizer`` steps are counted. ``param_grad_scale`` is the loss scale
    the gradients still carry (a fused optimizer under fp16 AMP unscales inside its step),
    divided out before they are counted.
    """
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    pairs = [
        (p, row)
        for p, row in zip(layout.params, layout.owner, strict=True)
        if p.grad is not None and id(p) in stepped
    ]
    grads = ParamLayout.grads([p for p, _ in pairs])  # a sparse gradient gives its coalesced values
    if param_grad_scale is not None:
        grads = [grad / param_grad_scale for grad in grads]
    hist.update(grads, [row for _, row in pairs])


class GradFlowPictures:
    """Draws an epoch's chart and heatmap, and writes its histograms.

    It holds the heatmap's columns, one per epoch of the fit, which checkpoints save.

    Args:
        max_layers_logged: the most layers whose scalars are logged. Histograms are written
            only for those layers
            (:func:`~lightning_hooks.core.stats.grad_flow.logged_rows`).
        chart: draw the chart of mean and max ``|g|`` per layer.
        heatmap: draw the heatmap of the gradient norm per layer and epoch.
    """

    def __init__(self, max_layers_logged: int | None, *, chart: bool, heatmap: bool) -> None:
        self.max_layers_logged = max_layers_logged
        self.chart = chart
        self.heatmap = heatmap
        self.history = EpochColumns()
        """The gradient norm per layer, one heatmap column per epoch of the fit."""

    def start(self) -> None:
        """Start a new fit's heatmap, forgetting the last fit's epochs."""
        self.history.clear()

    def write(
        self,
        trainer: TrainerView,
        stats: LayerTable,
        histograms: LayerHistograms | None,
        shards: ShardPlan | None,
    ) -> None:
        """Write the epoch's histograms, then on rank 0 its chart and heatmap.

        Under FSDP2, summing the histogram counts is a collective, so every rank takes part.
        An epoch with no logging step writes nothing.

        Args:
            trainer: the trainer whose loggers are written to, at :func:`~.attached.epoch_step`.
            stats: the epoch's values per layer.
            histograms: the epoch's histograms of ``log10 |g|``. ``None`` writes no histograms.
            shards: how the gradients are sharded across ranks under FSDP2. ``None`` means each
                rank holds the whole gradient.
        """
        if not stats.count.any():
            return
        if histograms is not None:
            self._write_histograms(trainer, stats, histograms, shards)
        if self.chart and trainer.is_global_zero:
            self._write_chart(trainer, stats)
        if self.heatmap and trainer.is_global_zero:
            self._write_heatmap(trainer, stats)

    def _write_chart(self, trainer: TrainerView, stats: LayerTable) -> None:
        """Draw the chart of mean and max ``|g|`` per layer, leaving out the global last row."""
        mean = stats.column("grad_abs_mean")[:-1]
        peak = stats.column("grad_abs_max", "peak")[:-1]
        title = f"gradient flow, epoch {trainer.current_epoch}"
        figure = grad_flow_figure(stats.layers[:-1], mean, peak, title=title)
        log_figure(trainer.loggers, family_tag(GRAD_FLOW, "chart"), figure, epoch_step(trainer))

    def _write_heatmap(self, trainer: TrainerView, stats: LayerTable) -> None:
        """Add the epoch's gradient norms, without the global last row, and draw the heatmap."""
        norms = {"grad_norm": stats.column("grad_norm")[:-1]}
        self.history.add(trainer.current_epoch, stats.layers[:-1], norms)
        layers, epochs, values = self.history.grid("grad_norm")
        title = "gradient norm per layer and epoch (mean over steps)"
        heatmap = layer_epoch_heatmap(layers, epochs, values, title=title, log=True)
        log_figure(trainer.loggers, family_tag(GRAD_FLOW, "heatmap"), heatmap, epoch_step(trainer))

    def _write_histograms(
        self,
        trainer: TrainerView,
        stats: LayerTable,
        hist: LayerHistograms,
        shards: ShardPlan | None,
    ) -> None:
        """Write the epoch's histograms of the logged layers on rank 0, then reset them."""
        # Gradients are all-reduced before the optimizer step, so rank 0's counts match every
        # rank's. Under FSDP2 each rank counted only its own shard, so the counts are summed.
        counts = (
            hist.host_counts() if shards is None else shards.sum(hist.counts).cpu().double().numpy()
        )
        limits = hist.limits()
        hist.reset()
        if not trainer.is_global_zero:
            return
        step = epoch_step(trainer)
        for row in logged_rows(stats, self.max_layers_logged):
            if counts[row].any():
                tag = grad_flow_tag("grad_log10_abs", stats.layers[row])
                binned = Binned(limits, counts[row])
                log_histogram(trainer.loggers, tag, binned, step)
