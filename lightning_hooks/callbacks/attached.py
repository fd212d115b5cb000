"""Define what one fit of a callback attaches to the model.

That is the registry of its hooks, the statistics those hooks feed, and what the callback
reads of their results. A callback builds it in its ``_attach``;
:class:`~.base.HookCallback` drives it through the fit and removes it at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from lightning_hooks.callbacks.trainer import TrainerView
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.core.transport import gather_objects
from lightning_hooks.internals.lightning import lightning_epoch_step
from lightning_hooks.logging import log_scalars
from lightning_hooks.tags import step_tags

__all__ = [
    "Attached",
    "Checkpointed",
    "EpochResult",
    "Logged",
    "Statistic",
    "Windowed",
    "epoch_step",
]

R = TypeVar("R")


class Windowed(Protocol[R]):
    """Describe a statistic measured at logging steps and copied to the host after each.

    Each logging step's values are copied to the host after its optimizer step, and read back
    when the copy is done.
    """

    def start_copy(self, step: int) -> None:
        """Start the host copy of the values measured since the last logging step.

        Args:
            step: the logging step the values belong to, returned with them by :meth:`take_copy`.
        """

    def take_copy(self, wait: bool) -> tuple[int, R] | None:
        """Return the copied step and its result once on the host, else ``None``.

        Args:
            wait: block until the copy is done (else return ``None`` while it is on its way).
        """

    @property
    def copy_in_flight(self) -> bool:
        """Tell whether a copy is still on its way to the host."""

    def step_values(self, result: R) -> dict[str, float]:
        """Return a logging step's values under their epoch tags.

        Each step tag is made from one of these tags.

        Args:
            result: the logging step's result, as :meth:`take_copy` returned it.
        """


class EpochResult(Protocol[R]):
    """Describe a statistic aggregated over an epoch's logging steps."""

    def result(self) -> R:
        """Return the epoch's result, reduced across ranks."""

    def reset(self) -> None:
        """Start the next epoch."""

    def tags(self, result: R) -> dict[str, float]:
        """Return the epoch's values under their tags.

        Args:
            result: the epoch's result, as :meth:`result` returned it.
        """


class Checkpointed(Protocol):
    """Describe what a callback saves in checkpoints, of a statistic or of a collaborator."""

    def host_state(self) -> dict[str, Any]:
        """Return the state to save, reduced across ranks, on the host."""

    def load_host_state(self, state: dict[str, Any]) -> None:
        """Continue from a state :meth:`host_state` saved.

        Args:
            state: the saved state, as read from a checkpoint (on the host).
        """


class Statistic(Windowed[R], EpochResult[R], Checkpointed, Protocol[R]):
    """Describe what a callback logs and saves of each statistic of a fit.

    A :class:`~lightning_hooks.core.stats.stat.LayerStat` is one, and so is a
    :class:`~lightning_hooks.core.GradFlowTracker`.
    """


class Logged(Generic[R]):
    """Pair a statistic of one fit with what its callback reads of its results.

    Beyond the scalar tags the statistic logs, a callback may read a picture, an alarm or a
    warning from its results; each reader is typed by the statistic's result.

    Args:
        stat: the statistic, whose step values and epoch tags are logged.
        on_step: called with the trainer, the step and the result of each logging step read back.
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
        """Write the epoch's ``result``: its tags, then what the callback reads of it.

        Args:
            trainer: the trainer whose loggers are written to, at the epoch's step
                (:func:`epoch_step`).
            result: the epoch's result, reduced across ranks.
        """
        log_scalars(trainer.loggers, self.stat.tags(result), epoch_step(trainer))
        if self.on_epoch is not None:
            self.on_epoch(trainer, result)


class Attached:
    """Hold what one fit of a callback put on the model.

    Args:
        registry: the registry of the fit's module hooks, whose logging-step gate the base sets
            at each batch (``None``: no module hook).
        logged: the statistics the hooks feed, logged at each logging step and epoch end.
        aligned: the statistics whose rows (the modules that ran) the ranks align before they
            reduce: a module that runs on some ranks only would otherwise hang the reduce.
        every_batch: the callback's ``_batch_ending`` runs at every batch, not only at a logging
            step's.
        on_remove: called once when the hooks come off (the fit ended, failed, or was torn down).
        earlier_layout: reads a checkpoint's state saved by an earlier release into this
            release's layout (``None``: every release saved this one).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from lightning_hooks.core.hooks.registry import HookRegistry
        >>> from lightning_hooks.core.stats.dead_units import DeadUnitTracker
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        >>> registry = HookRegistry(model)
        >>> tracker = DeadUnitTracker().attach(model, registry)
        >>> fit = Attached(registry, [Logged(tracker)], aligned=[tracker])
        >>> registry.set_logging_step(True)  # a logging step: the gate opens
        >>> output = model(torch.randn(3, 4, requires_grad=True))
        >>> tracker.layers  # the ReLU ran in a training forward: its row exists
        ('1',)
        >>> fit.remove()  # the fit ends: every hook comes off
        >>> len(registry)
        0
    """

    def __init__(  # noqa: PLR0913 (what one fit holds: one keyword each)
        self,
        registry: HookRegistry | None,
        logged: Sequence[Logged[Any]] = (),
        *,
        aligned: Sequence[LayerStat[Any]] = (),
        every_batch: bool = False,
        on_remove: Callable[[], None] | None = None,
        earlier_layout: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.registry = registry
        self.logged = tuple(logged)
        self.aligned = tuple(aligned)
        self.every_batch = every_batch
        self._on_remove = on_remove
        self._earlier_layout = earlier_layout
        self.copying = False
        """A logging step's values are on their way to the host, not all written yet."""

    def end_logging_step(self, trainer: TrainerView, step: int) -> None:
        """Write the last logging step's values, then start the host copies of this one's.

        Called after a logging step's optimizer step. The new copies are written once on the host:
        on the CPU at once, on CUDA at a later batch (see :meth:`write_steps`).

        Args:
            trainer: the trainer whose loggers are written to.
            step: the logging step whose values are copied.
        """
        self.write_steps(trainer, wait=True)
        for logged in self.logged:
            logged.stat.start_copy(step)
        self.copying = True
        self.write_steps(trainer, wait=False)

    def write_steps(self, trainer: TrainerView, wait: bool) -> None:
        """Write every logging step whose values are on the host.

        Args:
            trainer: the trainer whose loggers are written to.
            wait: block until each copy is done (else write what has arrived, if any is on its
                way).
        """
        if not (wait or self.copying):
            return
        for logged in self.logged:
            logged.write_step(trainer, wait)
        self.copying = not wait and self.copies_in_flight

    def write_epoch(self, trainer: TrainerView) -> None:
        """Write each statistic's epoch and start the next one.

        Every statistic's collective runs first, on every rank: a rank whose host side fails
        later has made them all.

        Args:
            trainer: the trainer whose loggers are written to, at the epoch's step
                (:func:`epoch_step`).
        """
        results = [(logged, logged.stat.result()) for logged in self.logged]
        for logged, result in results:
            logged.stat.reset()
            logged.write_epoch(trainer, result)

    @property
    def copies_in_flight(self) -> bool:
        """Tell whether a logging step's values are still on their way to the host."""
        return any(logged.stat.copy_in_flight for logged in self.logged)

    def rows_grew(self) -> bool:
        """Tell whether this rank made rows since they were last aligned across the ranks.

        Returns:
            ``True`` where a statistic of :attr:`aligned` has new rows.
        """
        return any(stat.rows_grew for stat in self.aligned)

    def align_rows(self) -> None:
        """Put every rank's new rows in one order on every rank (one ``all_gather_object``)."""
        new = gather_objects([stat.new_rows() for stat in self.aligned])
        for i, stat in enumerate(self.aligned):
            stat.align_rows([rank[i] for rank in new])

    def state_dict(self) -> dict[str, Any]:
        """Return the checkpoint state: each statistic's epoch so far.

        Returns:
            The states by key, reduced across ranks, on the host.
        """
        return {_state_name(i, s.stat): s.stat.host_state() for i, s in enumerate(self.logged)}

    def in_this_layout(self, state: dict[str, Any]) -> dict[str, Any]:
        """Return a checkpoint's ``state`` in this release's layout, whichever release saved it.

        Args:
            state: the callback's state as the checkpoint holds it.

        Returns:
            The same state, under the keys :meth:`state_dict` saves.
        """
        if self._earlier_layout is None:
            return dict(state)
        return self._earlier_layout(state)

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Continue from a checkpoint's ``state``.

        A statistic the checkpoint holds no entry of (one that the configuration saved with did
        not measure) starts its epoch afresh; the others continue.

        Args:
            state: the callback's state, in this release's layout (see :meth:`in_this_layout`);
                empty where it was saved outside a fit, and nothing is loaded.

        Returns:
            The statistics that start afresh for want of an entry, by class name.

        Raises:
            KeyError: the state is of another model (it holds no statistic's entry, or an entry
                lacks one of its statistic's states).
            ValueError: the state is of another model (its values do not fit the statistics).
                Nothing of the state is then kept: the statistics loaded before the one that
                did not fit start their epoch afresh too.
        """
        if not state:
            return []
        names = [_state_name(i, logged.stat) for i, logged in enumerate(self.logged)]
        if not any(name in state for name in names):
            raise KeyError(f"the checkpoint holds none of {names}")
        afresh = []
        try:
            for name, logged in zip(names, self.logged, strict=True):
                if name in state:
                    logged.stat.load_host_state(state[name])
                else:
                    afresh.append(type(logged.stat).__name__)
        except (KeyError, ValueError):
            for logged in self.logged:
                logged.stat.reset()
            raise
        return afresh

    def remove(self) -> None:
        """Take every hook off the model, then call ``on_remove`` (once)."""
        if self.registry is not None:
            self.registry.remove()
        on_remove = self._on_remove
        self._on_remove = None
        if on_remove is not None:
            on_remove()


def epoch_step(trainer: TrainerView) -> int:
    """Return the step every value of the ending epoch is written at.

    It is the step Lightning logs the epoch's own metrics at (a ``self.log(..., on_epoch=True)``,
    a validation metric of the epoch's end): the step of the epoch's last batch that stepped,
    ``trainer.global_step - 1`` where each such batch makes one optimizer step, read exactly as
    :func:`~lightning_hooks.internals.lightning.lightning_epoch_step` says. The epoch's last
    logging step, when it is the epoch's last step, shares it: its values are under the ``_step``
    tags. Under Fabric, where a :class:`~.fabric.FabricTrainer` stands in for the Trainer, it is
    the epoch's last optimizer step of the watched module, ``global_step - 1``, the step that
    logging step's values are written at.

    Args:
        trainer: the trainer whose epoch is ending, in ``on_train_epoch_end``.

    Returns:
        The step (-1 for a first epoch in which no batch stepped, as Lightning's).

    Example:
        >>> from types import SimpleNamespace
        >>> epoch_step(SimpleNamespace(global_step=44))  # a FabricTrainer: no fit loop
        43
    """
    step = lightning_epoch_step(trainer)
    return trainer.global_step - 1 if step is None else step


def _state_name(index: int, stat: Statistic[Any]) -> str:
    """Name a statistic in its callback's checkpoint state.

    Args:
        index: the statistic's place among the fit's.
        stat: the statistic, whose class names it.

    Returns:
        ``"<place>:<class>"``, for example ``"0:GradFlowTracker"``.
    """
    return f"{index}:{type(stat).__name__}"
