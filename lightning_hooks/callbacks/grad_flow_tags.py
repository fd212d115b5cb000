"""What ``GradFlowCallback`` writes at its logging steps and epoch ends (scalars, chart, heatmap,
histograms, instability statistics)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import pytorch_lightning as pl
import torch

from lightning_hooks.callbacks.alarm_policy import AlarmPolicy
from lightning_hooks.core import LayerHistograms, LayerTable, ParamLayout
from lightning_hooks.core.stats.grad_flow import GradFlowTracker
from lightning_hooks.core.stats.stability import StabilityStats
from lightning_hooks.logging import (
    Binned,
    grad_flow_figure,
    layer_epoch_heatmap,
    log_figure,
    log_histogram,
    log_scalars,
    step_tags,
)
from lightning_hooks.tags import GRAD_FLOW, grad_flow_tag

__all__ = ["GradFlowWriter", "Measured", "grad_flow_step_scalars", "observe_histograms"]

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
    ("grad_norm_preclip", "grad_norm_preclip", "mean"),
)


_PERCENTILES = (5, 50, 95)


def _epoch_scalars(
    stats: LayerTable, max_layers: int | None = None, step: bool = False
) -> Iterator[tuple[str, float]]:
    """``(tag, value)`` of an epoch's scalars, or a logging step's (``step``: without ``*_max``)."""
    last = len(stats.layers) - 1  # the global row
    rows = _logged_rows(stats, max_layers)
    if stats.count[-1, stats.stats.index("grad_norm_preclip")] > 0:  # clipped: the applied one
        yield grad_flow_tag("grad_norm_postclip"), float(stats.column("grad_norm")[-1])
    for suffix, stat, kind in _LOGGED:
        if step and suffix != stat:
            continue
        column = stats.column(stat, kind)
        counts = stats.count[:, stats.stats.index(stat)]
        for row in (*rows, last):
            if counts[row] == 0:
                continue
            layer = stats.layers[row]
            tag = grad_flow_tag(suffix, None if row == last else layer)
            yield tag, float(column[row])
        values = column[:last][(counts[:last] > 0) & np.isfinite(column[:last])]
        if len(rows) < last and values.size:  # percentiles over the layers
            for q, value in zip(_PERCENTILES, np.percentile(values, _PERCENTILES), strict=True):
                yield grad_flow_tag(f"{suffix}_p{q:02d}"), float(value)


def grad_flow_step_scalars(stats: LayerTable, max_layers: int | None = None) -> dict[str, float]:
    """The scalars of one logging step's window, by their epoch tag."""
    return dict(_epoch_scalars(stats, max_layers, step=True))


def _logged_rows(stats: LayerTable, max_layers: int | None) -> list[int]:
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


def observe_histograms(
    hist: LayerHistograms, layout: ParamLayout, optimizer: torch.optim.Optimizer
) -> None:
    """Count the gradients ``optimizer`` is about to apply into ``hist``, per layer."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    pairs = [
        (p, row)
        for p, row in zip(layout.params, layout.owner, strict=True)
        if p.grad is not None and id(p) in stepped
    ]
    grads = ParamLayout.grads([p for p, _ in pairs])  # sparse: the coalesced values
    hist.update(grads, [row for _, row in pairs])


class Measured(NamedTuple):
    """What a ``GradFlowCallback``'s fit measures, as its writer reads it."""

    tracker: GradFlowTracker
    stability: StabilityStats | None
    histograms: LayerHistograms | None
    policy: AlarmPolicy


class GradFlowWriter:
    """Writes ``GradFlowCallback``'s tags: each logging step's scalars, and each epoch's scalars,
    chart, heatmap, histograms, instability statistics and alarms. It holds the heatmap's
    columns, one per epoch of the fit."""

    def __init__(self, max_layers_logged: int | None, *, chart: bool, heatmap: bool) -> None:
        self.max_layers_logged = max_layers_logged
        self.chart, self.heatmap = chart, heatmap
        self.history: list[tuple[int, np.ndarray]] = []  # (epoch, grad_norm per layer)

    def write_window(self, trainer: pl.Trainer, measured: Measured, *, wait: bool) -> bool:
        """Write the logging step whose copy is done (``wait``: block for it); whether one was."""
        tracker = measured.tracker
        if (got := tracker.read_window(wait)) is None:
            return False
        step, stats = got
        scalars = grad_flow_step_scalars(stats, self.max_layers_logged)
        # Posted right after the tracker's window, at the same step: its copy is done too.
        stat = measured.stability
        if stat is not None and (window := stat.read_window(wait=True)):
            scalars.update(stat.step_values(window[1]))
            if (alarms := tracker.alarms) is not None:  # attention collapse: this step's measure
                at, found = window
                alarms.update_attention(found["attn_logit_max"], found["attn_entropy_min"], step=at)
        log_scalars(trainer.loggers, step_tags(scalars), step)
        return True

    def write_epoch(self, trainer: pl.Trainer, measured: Measured) -> None:
        """The epoch's scalars, chart, heatmap, histograms, instability statistics and alarms."""
        tracker = measured.tracker
        # The collectives first: a rank whose host side fails later has made them all.
        stats = tracker.result()
        tracker.reset()
        if (stability := measured.stability) is not None:  # a collective: every rank calls it
            result = stability.result()
            stability.reset()
            log_scalars(trainer.loggers, stability.tags(result), trainer.global_step)
        if measured.histograms is not None and stats.count.any():
            self._write_histograms(trainer, measured, stats)
        if tracker.alarms is not None:
            measured.policy.end_epoch(trainer, tracker.alarms)
        if not stats.count.any():
            return
        step = trainer.global_step
        log_scalars(trainer.loggers, dict(_epoch_scalars(stats, self.max_layers_logged)), step)
        if self.chart and trainer.is_global_zero:
            self._write_chart(trainer, stats)
        if self.heatmap and trainer.is_global_zero:
            self._write_heatmap(trainer, stats)

    def _write_chart(self, trainer: pl.Trainer, stats: LayerTable) -> None:
        mean, peak = stats.column("grad_abs_mean")[:-1], stats.column("grad_abs_max", "peak")[:-1]
        title = f"gradient flow, epoch {trainer.current_epoch}"
        figure = grad_flow_figure(stats.layers[:-1], mean, peak, title=title)
        log_figure(trainer.loggers, f"{GRAD_FLOW}/chart", figure, trainer.global_step)

    def _write_heatmap(self, trainer: pl.Trainer, stats: LayerTable) -> None:
        history = self.history
        history.append((trainer.current_epoch, stats.column("grad_norm")[:-1].copy()))
        values = np.stack([v for _, v in history], axis=1)
        title = "gradient norm per layer and epoch (mean over steps)"
        epochs = [e for e, _ in history]
        heatmap = layer_epoch_heatmap(stats.layers[:-1], epochs, values, title=title, log=True)
        log_figure(trainer.loggers, f"{GRAD_FLOW}/heatmap", heatmap, trainer.global_step)

    def _write_histograms(self, trainer: pl.Trainer, measured: Measured, stats: LayerTable) -> None:
        """Write the epoch's histograms of the logged layers (rank 0), then reset them."""
        hist, shards = measured.histograms, measured.tracker.shards
        assert hist is not None
        # Gradients are all-reduced before the optimizer step: rank 0's counts are every rank's.
        # FSDP2: each rank counted its shard's entries; the whole gradient is their sum.
        counts = (
            hist.host_counts() if shards is None else shards.sum(hist.counts).cpu().double().numpy()
        )
        limits = hist.limits()
        hist.reset()
        if not trainer.is_global_zero:
            return
        for row in _logged_rows(stats, self.max_layers_logged):
            if counts[row].any():
                tag = grad_flow_tag("grad_log10_abs", stats.layers[row])
                binned = Binned(limits, counts[row])
                log_histogram(trainer.loggers, tag, binned, trainer.global_step)
