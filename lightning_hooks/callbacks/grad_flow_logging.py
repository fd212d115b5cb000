"""What ``GradFlowCallback`` writes: its logging steps, its epoch (scalars, chart, heatmap,
histograms, the instability statistics) and its checkpoint state.

:class:`GradFlowLogging` is the writing half of
:class:`~lightning_hooks.callbacks.grad_flow.GradFlowCallback`, which sets the attributes it
declares; the hooks and the alarms live there.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytorch_lightning as pl
from typing_extensions import override

from lightning_hooks.callbacks.alarm_policy import AlarmPolicy
from lightning_hooks.callbacks.base import HookCallback
from lightning_hooks.callbacks.grad_flow_tags import (
    grad_flow_scalars,
    grad_flow_step_scalars,
    write_histograms,
)
from lightning_hooks.core import GradFlowTracker, LayerHistograms, LayerStats
from lightning_hooks.core.stats.stability import StabilityStats
from lightning_hooks.logging import (
    grad_flow_figure,
    layer_epoch_heatmap,
    log_figure,
    log_scalars,
    step_tags,
)

__all__ = ["GradFlowLogging"]


class GradFlowLogging(HookCallback):
    """The logging steps, the epoch end and the checkpoint state of ``GradFlowCallback``."""

    _tracker: GradFlowTracker | None
    _stability: StabilityStats | None
    _hist: LayerHistograms | None
    _history: list[tuple[int, np.ndarray]]
    policy: AlarmPolicy
    max_layers_logged: int | None
    chart: bool
    heatmap: bool

    @override
    def _log_step(self, trainer: pl.Trainer, step: int) -> None:
        if self._tracker is None:
            return
        self._tracker.post_window(step)
        if self._stability is not None:
            self._stability.post_window(step)
        if self._tracker.alarms is not None:
            self.policy.log_step(trainer, self._tracker.alarms, step)

    @override
    def _steps_in_flight(self) -> bool:
        tracker, stat = self._tracker, self._stability
        return (tracker is not None and tracker.window_in_flight) or (
            stat is not None and stat.window_in_flight
        )

    @override
    def _write_steps(self, trainer: pl.Trainer, wait: bool) -> bool:
        tracker = self._tracker
        got = None if tracker is None else tracker.read_window(wait)
        if tracker is None or got is None:
            return False
        step, stats = got
        scalars = grad_flow_step_scalars(stats, self.max_layers_logged)
        stat = self._stability
        # Posted right after the tracker's window, at the same step: its copy is done too.
        window = None if stat is None else stat.read_window(wait=True)
        if stat is not None and window is not None:
            scalars.update(stat.step_values(window[1]))
            if tracker.alarms is not None:  # attention collapse: this logging step's measure
                at, found = window
                tracker.alarms.update_attention(
                    found["attn_logit_max"], found["attn_entropy_min"], step=at
                )
        log_scalars(trainer.loggers, step_tags(scalars), step)
        return True

    @override
    def _save_state(self) -> dict[str, Any]:
        state = {} if self._tracker is None else self._tracker.state()
        if self._stability is not None:
            state["stability"] = self._stability.host_state()
        alarm_state = self.policy.state(self._tracker.alarms if self._tracker else None)
        return state if alarm_state is None else {**state, "alarms": alarm_state}

    @override
    def _load_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.policy.saved = state.pop("alarms", self.policy.saved)
        stability = state.pop("stability", None)
        if self._tracker is not None:
            self.policy.restore(self._tracker.alarms)
            if state:
                self._tracker.load_state(state)
        if self._stability is not None and stability is not None:
            self._stability.load_host_state(stability)

    @override
    def _log_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._tracker is None:
            return
        # The collectives first: a rank whose host side fails later has made them all.
        stats = self._tracker.result()
        self._tracker.reset()
        self._log_stability(trainer)
        if self._hist is not None and stats.count.any():
            shards = self._tracker.shards
            write_histograms(trainer, self._hist, stats, self.max_layers_logged, shards)
        if self._tracker.alarms is not None:
            self.policy.end_epoch(trainer, self._tracker.alarms)
        if not stats.count.any():
            return
        step = trainer.global_step
        log_scalars(trainer.loggers, dict(grad_flow_scalars(stats, self.max_layers_logged)), step)
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

    def _log_stability(self, trainer: pl.Trainer) -> None:
        """Log the instability statistics of the sampled steps so far, then start afresh."""
        if self._stability is not None:
            result = self._stability.result()  # a collective: every rank calls it
            self._stability.reset()
            log_scalars(trainer.loggers, self._stability.tags(result), trainer.global_step)

    def _log_heatmap(self, trainer: pl.Trainer, stats: LayerStats, step: int) -> None:
        layers, epoch = stats.layers[:-1], trainer.current_epoch
        self._history.append((epoch, stats.column("grad_norm")[:-1].copy()))
        epochs = [e for e, _ in self._history]
        values = np.stack([v for _, v in self._history], axis=1)
        title = "gradient norm per layer and epoch (mean over steps)"
        heatmap = layer_epoch_heatmap(layers, epochs, values, title=title, log=True)
        log_figure(trainer.loggers, "grad_flow/heatmap", heatmap, step)
