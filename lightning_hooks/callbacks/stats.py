"""The ``StatsCallback``, which logs any :class:`~.stat.LayerStat` and saves it in checkpoints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.attached import Logged
from lightning_hooks.callbacks.base import HookCallback
from lightning_hooks.callbacks.trainer import TrainerView
from lightning_hooks.callbacks.watching import attach_stats, watches_selection
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.guard import guarded
from lightning_hooks.core.stats.stat import LayerStat

__all__ = ["StatsCallback"]

# The bare class: jsonargparse (LightningCLI) resolves a ``class_path`` against a class, not
# against the subscripted generic ``LayerStat[Any]``.
_AnyStat = LayerStat


@named_arguments
class StatsCallback(HookCallback):
    """Hooks each statistic on the model during the training forward of each logging step.

    Each statistic logs its ``step_values`` at each logging step (see docs/glossary.md) and its
    ``tags`` at each epoch end, and its state is saved in checkpoints.

    Args:
        stats: one statistic or a sequence of them. Each is attached afresh at every fit.
        every_n_steps: measure on optimizer steps ``n-1, 2n-1, ...`` and on the first step of
            each epoch. ``None`` uses the Trainer's ``log_every_n_steps``, and 1 measures every
            step.

    Raises:
        TypeError: if ``stats`` is neither a statistic nor a non-empty sequence of them.

    Example:
        >>> from lightning_hooks.core.stats.activation_stats import ActivationStatsTracker
        >>> callback = StatsCallback(ActivationStatsTracker(), every_n_steps=1)
        >>> len(callback.stats)
        1
    """

    def __init__(
        self,
        stats: _AnyStat | Sequence[_AnyStat],  # type: ignore[type-arg]
        *,
        every_n_steps: int | None = None,
    ) -> None:
        items: tuple[object, ...] = ()
        if isinstance(stats, LayerStat):
            items = (stats,)
        elif isinstance(stats, Sequence):  # a string passes here, and the check below refuses it
            items = tuple(stats)
        if not items or not all(isinstance(s, LayerStat) for s in items):
            raise TypeError(
                f"{type(self).__name__}(stats={stats!r}): must be a LayerStat or a non-empty "
                f"sequence of them, got {stats!r}"
            )
        chosen = tuple(s for s in items if isinstance(s, LayerStat))
        super().__init__(
            state_key={"stats": [s.config_key() for s in chosen]}, every_n_steps=every_n_steps
        )
        self.stats: tuple[LayerStat[Any], ...] = chosen

    @override
    def on_fit_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Check that the statistics select some module of the model."""
        if self.lifecycle.watching:
            name = type(self).__name__
            self.lifecycle.watching = watches_selection(
                name, pl_module, self.stats, what="module", selected={}
            )

    @override
    @guarded
    def on_train_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Hook each statistic on the model for this fit."""
        if self.lifecycle.start_training():
            logged = [Logged(stat) for stat in self.stats]
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
        """Write a logging step once its optimizer step has run."""
        self.lifecycle.end_batch(trainer)

    @override
    @guarded
    def on_train_epoch_end(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Log each statistic's epoch aggregates."""
        self.lifecycle.end_epoch(trainer)
