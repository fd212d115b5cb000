"""The ``LayerTimeCallback``, which times each layer's forward pass on logging steps."""

from __future__ import annotations

from typing import Any

from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.attached import Logged, epoch_step
from lightning_hooks.callbacks.base import HookCallback
from lightning_hooks.callbacks.fabric_run import UNDER_FABRIC
from lightning_hooks.callbacks.trainer import TrainerView
from lightning_hooks.callbacks.watching import attach_stats, watches_selection
from lightning_hooks.core.checks import boolean, named_arguments
from lightning_hooks.core.hooks.guard import guarded
from lightning_hooks.core.hooks.selection import ModuleTypes, Patterns, as_patterns
from lightning_hooks.core.stats.layer_time import LayerTimer, LayerTimes
from lightning_hooks.logging import layer_time_figure, log_figure
from lightning_hooks.tags import LAYER_TIME, family_tag

__all__ = ["LayerTimeCallback"]


@named_arguments
class LayerTimeCallback(HookCallback):
    r"""Times every layer's forward on logging steps, in ms and as a share of the step.

    Logged metrics, per epoch, means over the epoch's logging steps; each logging step also logs
    the same tags with ``_step`` after the statistic (``layer_time/step_ms_step``):

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
        every_n_steps: time optimizer steps ``n-1, 2n-1, ...`` and each epoch's first
            (``None``: the Trainer's ``log_every_n_steps``).
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

    def __init__(  # noqa: PLR0913 (a callback's public constructor: one keyword per option)
        self,
        *,
        every_n_steps: int | None = None,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        leaves: bool = True,
        chart: bool = True,
    ) -> None:
        owner = type(self).__name__  # a subclass's own name, as the lifecycle's messages give
        self.leaves = boolean(owner, "leaves", leaves)
        self.chart = boolean(owner, "chart", chart)
        include = as_patterns(include, f"{owner}(include={include!r})")
        exclude = as_patterns(exclude, f"{owner}(exclude={exclude!r})")
        timer = LayerTimer(
            types=types, include=include, exclude=exclude, leaves=self.leaves, owner=owner
        )
        super().__init__(
            state_key={"stats": [timer.config_key()]},
            every_n_steps=every_n_steps,
            uses_images=self.chart,
            fabric_refusal="it times on the LightningModule's device (pl_module.device), which a "
            f"plain nn.Module set up by Fabric does not have. {UNDER_FABRIC}",
        )
        self.types = types
        self.include = include
        self.exclude = exclude
        self._timer = timer

    @override
    def on_fit_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Check that the selection finds some module of the model."""
        if self.lifecycle.watching:
            selected = {"types": self.types, "include": self.include, "exclude": self.exclude}
            self.lifecycle.watching = watches_selection(
                self.lifecycle.owner, pl_module, [self._timer], what="module", selected=selected
            )

    @override
    @guarded
    def on_train_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Hook the timer on the selected modules; each epoch's times go to :meth:`_draw_chart`."""
        if self.lifecycle.start_training():
            logged = [Logged(self._timer, on_epoch=self._draw_chart)]
            self.lifecycle.attach(attach_stats(pl_module, self.hook_guard(), logged))

    @override
    @guarded
    def on_train_batch_start(
        self, trainer: TrainerView, pl_module: nn.Module, batch: Any, batch_idx: int
    ) -> None:
        """Start the step's clock where the batch belongs to a logging step."""
        if self.lifecycle.start_batch(trainer, batch_idx):
            self._timer.start_step(trainer.global_step)

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
        """Stop the step's clock, then write a logging step once its optimizer step has run."""
        if self.lifecycle.measuring:
            self._timer.end_step()
        self.lifecycle.end_batch(trainer)

    @override
    @guarded
    def on_train_epoch_end(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Write the epoch's mean times; their reader :meth:`_draw_chart` draws the chart."""
        self.lifecycle.end_epoch(trainer)

    def _draw_chart(self, trainer: TrainerView, times: LayerTimes) -> None:
        """Draw the epoch's forward time per layer, on rank 0, with ``chart``.

        Args:
            trainer: the trainer whose loggers get the chart; its epoch is in the title.
            times: the epoch's mean forward time per layer and step time.
        """
        if times.steps == 0 or not trainer.is_global_zero or not self.chart:
            return
        epoch = trainer.current_epoch
        step_ms = times.step_ms
        title = f"forward time per layer, epoch {epoch}, step {step_ms:.2f} ms"
        figure = layer_time_figure(times.layers, times.forward_ms, step_ms, title=title)
        step = epoch_step(trainer)
        log_figure(trainer.loggers, family_tag(LAYER_TIME, "chart"), figure, step)
