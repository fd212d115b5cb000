"""``LayerTimeCallback``: forward time per layer on sampled steps, and its share of the step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytorch_lightning as pl
from typing_extensions import override

from lightning_hooks.callbacks._base import HookCallback
from lightning_hooks.core import select_modules
from lightning_hooks.core.layer_time import LayerTimer, LayerTimes
from lightning_hooks.core.selection import ModuleTypes, Patterns, as_patterns
from lightning_hooks.logging import layer_time_figure, log_figure, log_scalars

__all__ = ["LayerTimeCallback"]


class LayerTimeCallback(HookCallback):
    r"""Forward time of every layer on sampled training steps, as ms and as a share of the step.

    Every ``every_n_steps``-th training batch (the first one included) is *sampled*: a forward
    pre-hook and a forward hook on each layer mark its start and end (``time.perf_counter`` on
    the CPU; CUDA events on a GPU, read once at epoch end, so no step waits for the device), and
    the step is marked from ``on_train_batch_start`` to ``on_train_batch_end`` (forward,
    backward and optimizer step; not data loading). On the other batches each hook returns after
    one Python attribute check. A *layer* is a leaf module (a module without children:
    ``Conv2d``, ``ReLU``, ``Flatten``, ...), so no time is counted twice and the shares sum to at
    most 1. Time spent in ``forward`` outside any module (functional ops) belongs to no layer.

    Backward time per layer is not measured: it needs full backward hooks, which break in-place
    ops and cost several times a forward hook. Under DDP each rank times itself; rank 0 logs.

    Cost, measured with ``examples/overhead.py`` on a small CNN (CPU, 2 shared cores): see the
    README. With ``every_n_steps=1`` every step pays two clock reads per leaf module.

    Logged metrics, per epoch, means over the epoch's sampled steps:

    =================================  ========================================================
    Tag                                Value
    =================================  ========================================================
    ``layer_time/forward_ms/{layer}``  the layer's forward time per step, milliseconds
    ``layer_time/share/{layer}``       ``forward_ms / step_ms``
    ``layer_time/step_ms``             wall time of a training step, milliseconds
    ``layer_time/forward_share``       sum of the layers' shares
    ``layer_time/chart`` (image)       bar chart of ``forward_ms`` per layer, with shares
    =================================  ========================================================

    Args:
        every_n_steps: time every n-th training batch (default 50: about 2% of the steps).
        types: only modules of these types.
        include: glob patterns on qualified module names to keep.
        exclude: glob patterns on qualified module names to drop.
        leaves: time only modules without children (``False``: a parent's time also
            contains its children's, and the shares may sum to more than 1).
        chart: log the bar chart image each epoch.

    Example:
        >>> callback = LayerTimeCallback(every_n_steps=10, exclude="head")
        >>> callback.every_n_steps
        10
    """

    def __init__(
        self,
        *,
        every_n_steps: int = 50,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        leaves: bool = True,
        chart: bool = True,
    ) -> None:
        if (
            isinstance(every_n_steps, bool)
            or not isinstance(every_n_steps, int)
            or every_n_steps < 1
        ):
            raise ValueError(
                f"LayerTimeCallback(every_n_steps={every_n_steps!r}): must be a positive int, "
                f"got {every_n_steps!r}"
            )
        self.every_n_steps = every_n_steps
        self.types = types
        self.include = as_patterns(include, "LayerTimeCallback(include=...)")
        self.exclude = as_patterns(exclude, "LayerTimeCallback(exclude=...)")
        self.leaves = leaves
        self.chart = chart
        self.uses_images = chart
        self._timer: LayerTimer | None = None
        self._batches = 0

    @override
    def _validate(self, pl_module: pl.LightningModule) -> None:
        select_modules(pl_module, types=self.types, include=self.include, exclude=self.exclude)

    @override
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._batches = 0
        self._timer = LayerTimer(
            pl_module,
            types=self.types,
            include=self.include,
            exclude=self.exclude,
            leaves=self.leaves,
            cuda=pl_module.device.type == "cuda",
        )

    @override
    def _detach(self) -> None:
        if self._timer is not None:
            self._timer.remove()
            self._timer = None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._timer is not None and self._batches % self._cadence(trainer) == 0:
            self._timer.start_step()
        self._batches += 1

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._timer is not None:
            self._timer.end_step()

    @override
    def _log_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timer is None:
            return
        self._timer.end_step()  # a step cut short by a skipped batch closes here
        times = self._timer.result()
        self._timer.reset()
        if times.steps == 0 or not trainer.is_global_zero:
            return
        step = trainer.global_step
        log_scalars(trainer.loggers, dict(_scalars(times)), step)
        if self.chart:
            figure = layer_time_figure(
                times.layers,
                times.forward_ms,
                times.step_ms,
                title=f"forward time per layer, epoch {trainer.current_epoch}, "
                f"step {times.step_ms:.2f} ms",
            )
            log_figure(trainer.loggers, "layer_time/chart", figure, step)


def _scalars(times: LayerTimes) -> Iterator[tuple[str, float]]:
    share = times.share
    for layer, ms, fraction, calls in zip(
        times.layers, times.forward_ms, share, times.calls, strict=True
    ):
        if calls:
            yield f"layer_time/forward_ms/{layer}", float(ms)
            yield f"layer_time/share/{layer}", float(fraction)
    yield "layer_time/step_ms", times.step_ms
    yield "layer_time/forward_share", float(share.sum())
