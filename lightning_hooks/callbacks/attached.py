"""The record of what one fit of a callback attaches to the model.

This is the registry of the fit's hooks, the statistics they feed, and the functions that read
the results. A callback builds it in its ``on_train_start`` and hands it to its
:class:`~.lifecycle.Lifecycle`, which writes and removes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from lightning_hooks.callbacks.trainer import FitProgress, TrainerView
from lightning_hooks.core.distributed import gather_objects
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.internals.lightning import lightning_epoch_step
from lightning_hooks.logging import log_scalars
from lightning_hooks.tags import step_tags

__all__ = [
    "Attached",
    "Checkpointed",
    "EpochResult",
    "Logged",
    "Statistic",
    "StepValues",
    "epoch_step",
]

R = TypeVar("R")


class StepValues(Protocol[R]):
    """A statistic measured at logging steps, whose values are copied to the host.

    The copy starts after the logging step's optimizer step, and the values are read once it
    is done.
    """

    def start_copy(self, step: int) -> None:
        """Start the host copy of the values measured since the last logging step, ``step``."""

    def take_copy(self, wait: bool) -> tuple[int, R] | None:
        """Return the copied step and result; ``None`` if it has not arrived (unless ``wait``)."""

    @property
    def copy_in_flight(self) -> bool:
        """Return whether a copy is still on its way to the host."""

    def step_values(self, result: R) -> dict[str, float]:
        """Return a logging step's values by their epoch tags, which the caller makes step tags."""


class EpochResult(Protocol[R]):
    """A statistic aggregated over an epoch's logging steps."""

    def result(self) -> R:
        """Return the epoch's result, reduced across ranks."""

    def reset(self) -> None:
        """Start the next epoch."""

    def tags(self, result: R) -> dict[str, float]:
        """Return the values of the epoch's ``result`` under their tags."""


class Checkpointed(Protocol):
    """A statistic or collaborator whose state a callback saves in checkpoints."""

    def host_state(self) -> dict[str, Any]:
        """Return the state to save, reduced across ranks, on the host."""

    def load_host_state(self, state: dict[str, Any]) -> None:
        """Continue from a state :meth:`host_state` saved, as read from a checkpoint."""


class Statistic(StepValues[R], EpochResult[R], Checkpointed, Protocol[R]):
    """A statistic that a callback logs and saves, such as a ``GradFlowTracker``.

    Each part is what one caller reads: :class:`Logged` the logging steps (:class:`StepValues`)
    and the epochs (:class:`EpochResult`), the checkpoint slot the state (:class:`Checkpointed`).
    No statistic implements them by hand: ``LayerStat`` and ``LayerStatsAccumulator`` (the
    gradient flow's) implement all three once, as torchmetrics' ``Metric`` does its own.
    """


class Logged(Generic[R]):
    """A statistic of one fit, paired with the functions that read its results.

    The statistic logs its own scalar values; the functions may draw a picture, raise an alarm
    or give a warning from the results.

    Args:
        stat: the statistic, whose step values and epoch tags are logged.
        on_step: called with the trainer, the step and the result of each logging step, once
            its values are back on the host.
        on_epoch: called with the trainer and the result of each epoch, after its tags are logged.

    Example:
        >>> from lightning_hooks.core.stats.dead_units import DeadUnits, DeadUnitTracker
        >>> def warn_dead(trainer, found: DeadUnits) -> None:
        ...     print(found.layers)
        >>> logged = Logged(DeadUnitTracker(), on_epoch=warn_dead)
        >>> logged.on_step is None  # nothing read at a logging step beyond the scalars
        True
    """

    def __init__(
        self,
        stat: Statistic[R],
        *,
        on_step: Callable[[TrainerView, int, R], None] | None = None,
        on_epoch: Callable[[TrainerView, R], None] | None = None,
    ) -> None:
        self.stat = stat
        self.on_step = on_step
        self.on_epoch = on_epoch

    def write_step(self, trainer: TrainerView, wait: bool) -> None:
        """Write the last logging step's values once they are on the host.

        Args:
            trainer: the trainer whose loggers are written to.
            wait: block until the copy is done.
        """
        copied = self.stat.take_copy(wait)
        if copied is None:
            return
        step, result = copied
        log_scalars(trainer.loggers, step_tags(self.stat.step_values(result)), step)
        if self.on_step is not None:
            self.on_step(trainer, step, result)

    def write_epoch(self, trainer: TrainerView, result: R) -> None:
        """Write the epoch's ``result`` at :func:`epoch_step`, then call ``on_epoch`` with it.

        Args:
            trainer: the trainer whose loggers are written to.
            result: the epoch's result, reduced across ranks.
        """
        log_scalars(trainer.loggers, self.stat.tags(result), epoch_step(trainer))
        if self.on_epoch is not None:
            self.on_epoch(trainer, result)


class Attached:
    """What one fit of a callback put on the model.

    Args:
        registry: the registry of the fit's module hooks, which the lifecycle tells at each batch
            whether it belongs to a logging step. ``None`` if the fit has no module hook.
        logged: the statistics the hooks feed, logged at each logging step and epoch end.
        aligned: the statistics whose rows the ranks align before they reduce them. Without
            it, a module that runs on only some ranks would make the reduce hang.
        on_remove: called once when the module hooks are removed (the fit ended, failed, or was
            torn down).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from lightning_hooks.core.hooks.registry import HookRegistry
        >>> from lightning_hooks.core.stats.dead_units import DeadUnitTracker
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        >>> registry = HookRegistry(model)
        >>> tracker = DeadUnitTracker().attach(model, registry)
        >>> fit = Attached(registry, [Logged(tracker)], aligned=[tracker])
        >>> registry.set_logging_step(True)  # a logging step: the module hooks go on
        >>> output = model(torch.randn(3, 4, requires_grad=True))
        >>> tracker.layers  # the ReLU ran in a training forward: its row exists
        ('1',)
        >>> fit.remove()  # the fit ends: every module hook is removed
        >>> len(registry)
        0
    """

    def __init__(
        self,
        registry: HookRegistry | None,
        logged: Sequence[Logged[Any]] = (),
        *,
        aligned: Sequence[LayerStat[Any]] = (),
        on_remove: Callable[[], None] | None = None,
    ) -> None:
        self.registry = registry
        self.logged = tuple(logged)
        self.aligned = tuple(aligned)
        self._on_remove = on_remove
        self._copying = False

    def end_logging_step(self, trainer: TrainerView, step: int) -> None:
        """Write the last logging step's values, then start the host copies of ``step``'s.

        The lifecycle calls this after a logging step's optimizer step. The new copies are written
        once they reach the host: on the CPU at once, on CUDA at a later batch.

        Args:
            trainer: the trainer whose loggers are written to.
            step: the logging step whose optimizer step has just run.
        """
        self.write_steps(trainer, wait=True)
        for logged in self.logged:
            logged.stat.start_copy(step)
        self._copying = True
        self.write_steps(trainer, wait=False)

    def write_arrived_steps(self, trainer: TrainerView) -> None:
        """Write the logging steps whose copies have reached the host since the last look.

        The lifecycle calls this at every batch's start. A batch after which no copy is on its way,
        which is most of them, looks at no statistic.

        Args:
            trainer: the trainer whose loggers are written to.
        """
        if self._copying:
            self.write_steps(trainer, wait=False)

    def write_steps(self, trainer: TrainerView, wait: bool) -> None:
        """Write every logging step whose values are on the host.

        Args:
            trainer: the trainer whose loggers are written to.
            wait: block until each copy is done. If ``False``, write only those that arrived.
        """
        for logged in self.logged:
            logged.write_step(trainer, wait)
        self._copying = not wait and self.copies_in_flight

    def write_epoch(self, trainer: TrainerView) -> None:
        """Write each statistic's epoch at :func:`epoch_step` and start the next one.

        The collectives of all statistics run first, on every rank, so a rank that fails later,
        while it writes on the host, has still taken part in every collective.

        Args:
            trainer: the trainer whose loggers are written to, at the epoch's step.
        """
        results = [(logged, logged.stat.result()) for logged in self.logged]
        for logged, result in results:
            logged.stat.reset()
            logged.write_epoch(trainer, result)

    @property
    def copies_in_flight(self) -> bool:
        """Return whether a logging step's values are still on their way to the host."""
        return any(logged.stat.copy_in_flight for logged in self.logged)

    def rows_grew(self) -> bool:
        """Return whether any statistic of :attr:`aligned` has new rows since the last alignment."""
        return any(stat.rows_grew for stat in self.aligned)

    def align_rows(self) -> None:
        """Put every rank's new rows in one order on every rank (one ``all_gather_object``)."""
        new = gather_objects([stat.new_rows() for stat in self.aligned])
        for i, stat in enumerate(self.aligned):
            stat.align_rows([rank[i] for rank in new])

    def remove(self) -> None:
        """Remove every module hook from the model, then call ``on_remove`` (once)."""
        if self.registry is not None:
            self.registry.remove()
        on_remove = self._on_remove
        self._on_remove = None
        if on_remove is not None:
            on_remove()


def epoch_step(trainer: FitProgress) -> int:
    """Return the step every value of the ending epoch is written at.

    This is the step at which Lightning logs the epoch's own metrics, such as a
    ``self.log(..., on_epoch=True)``: the step of the epoch's last batch that made an optimizer
    step (usually ``trainer.global_step - 1``). A logging step on the same step keeps its values
    apart under the ``_step`` tags. Under Fabric, where a :class:`~.fabric_run.FabricTrainer`
    stands in for the Trainer, it is the watched module's last optimizer step of the epoch.

    Args:
        trainer: the trainer (or Fabric's stand-in) of the ending epoch.

    Returns:
        The step (-1 for a first epoch in which no batch stepped, as Lightning's).

    Example:
        >>> from types import SimpleNamespace
        >>> epoch_step(SimpleNamespace(global_step=44))  # a FabricTrainer: no fit loop
        43
    """
    step = lightning_epoch_step(trainer)
    return trainer.global_step - 1 if step is None else step
