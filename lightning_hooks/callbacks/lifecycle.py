"""The lifecycle every callback shares: one fit at a time, under a guard, at the logging steps.

A callback holds one :class:`Lifecycle` and calls it from its Lightning hooks by name, as
Lightning's ``ThroughputMonitor`` calls its ``Throughput``. The lifecycle never calls the
callback's methods. It calls only the functions passed in the callback's
:class:`~.attached.Attached`: each ``Logged``'s ``on_step`` and ``on_epoch``, and
``Attached.on_remove``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_hooks.callbacks.attached import Attached
from lightning_hooks.callbacks.cadence import LoggingCadence, check_every_n_steps
from lightning_hooks.callbacks.checkpoint import CheckpointSlot, rolls_over
from lightning_hooks.callbacks.ranks import RankAgreement
from lightning_hooks.callbacks.trainer import TrainerView, check_trainer
from lightning_hooks.core.hooks.guard import Guard
from lightning_hooks.logging import save_loggers

__all__ = ["FitState", "Lifecycle"]


@dataclass
class FitState:
    """The state of one fit of a callback, from its ``setup`` to the next fit's ``setup``.

    Each fit's ``setup`` makes a new one, so a fit starts healthy whatever happened before.
    """

    guard: Guard
    ranks: RankAgreement
    """Makes the ranks of the fit agree on failures, stops and new rows, under its guard."""
    cadence: LoggingCadence
    """Which of the fit's optimizer steps are logging steps, and where the running one is."""
    watching: bool = True
    """Whether the callback watches the model in this fit. It does not where the model has
    nothing to watch, or where a callback the user passed already watches it."""
    attached: Attached | None = None
    """What the fit put on the model, from its train start until its module hooks are removed."""
    measuring: bool = False
    """Whether the running batch belongs to a logging step that the fit measures."""
    restored_epoch: int | None = None
    """The epoch a checkpoint's statistics were of, until the fit's first batch compares it
    with its own."""


class Lifecycle:
    """Runs what every callback does in each fit, whatever it measures.

    A callback calls it from its Lightning hooks:

    - ``setup``: :meth:`start_fit`, with a new guard.
    - ``on_fit_start``: the callback checks the model, and sets :attr:`watching` to ``False``
      where there is nothing to watch.
    - ``on_train_start``: :meth:`start_training`, then, where it returns ``True``, the callback
      registers its module hooks and hands them to :meth:`attach`.
    - ``on_train_batch_start``: :meth:`start_batch`, which says whether the batch is measured.
    - ``on_train_batch_end``: :meth:`end_batch`, which writes a logging step once its optimizer
      step has run.
    - ``on_train_epoch_end``: :meth:`end_epoch`, which writes each statistic's epoch.
    - ``on_train_end``, ``on_exception`` and ``teardown``: :meth:`end_training`, :meth:`flush`
      and :meth:`remove_hooks`, which remove the module hooks.
    - ``state_dict`` and ``load_state_dict``: :meth:`state_dict` and :attr:`checkpoint`.

    Args:
        owner: the callback's name, which begins its messages.
        guard: the guard of the hooks until the first fit's ``setup`` makes its own.
        every_n_steps: the cadence of the logging steps (see :class:`~.cadence.LoggingCadence`).
        uses_images: whether the callback draws pictures. A logger that cannot show them
            triggers one warning.

    Raises:
        ValueError: ``every_n_steps`` is not a positive int or ``None``.

    Example:
        >>> guard = Guard("Watcher", strict=False)
        >>> lifecycle = Lifecycle("Watcher", guard, every_n_steps=10, uses_images=False)
        >>> lifecycle.every_n_steps
        10
        >>> lifecycle.attached is None  # nothing is on a model before a fit's train start
        True
    """

    def __init__(
        self, owner: str, guard: Guard, *, every_n_steps: int | None, uses_images: bool
    ) -> None:
        self.owner = owner
        self.uses_images = uses_images
        self.every_n_steps = check_every_n_steps(owner, every_n_steps)
        """The cadence of the logging steps; ``None``: the Trainer's ``log_every_n_steps``."""
        self.checkpoint = CheckpointSlot(owner)
        """Saves the callback's state in checkpoints, and restores it when a fit attaches."""
        self._state = self._new_fit(guard, watching=True)

    def _new_fit(self, guard: Guard, *, watching: bool) -> FitState:
        """Make the state of a fit that starts healthy, under ``guard``."""
        ranks = RankAgreement(guard, remove_hooks=self.remove_hooks)
        cadence = LoggingCadence(self.every_n_steps)
        return FitState(guard, ranks, cadence, watching=watching)

    @property
    def guard(self) -> Guard:
        """Return the guard of this fit's hooks; its ``failed`` says whether the fit failed."""
        return self._state.guard

    @property
    def ranks(self) -> RankAgreement:
        """Return the agreement of this fit's ranks on failures, stops and new rows."""
        return self._state.ranks

    @property
    def watching(self) -> bool:
        """Return whether the callback watches the model in this fit."""
        return self._state.watching

    @watching.setter
    def watching(self, watching: bool) -> None:
        self._state.watching = watching

    @property
    def attached(self) -> Attached | None:
        """Return what the fit put on the model, or ``None`` outside its train start and end."""
        return self._state.attached

    @property
    def cadence(self) -> LoggingCadence:
        """Return this fit's cadence: which steps are logging steps, and the running one."""
        return self._state.cadence

    @property
    def batch_step(self) -> int:
        """Return the optimizer step the running batch feeds."""
        return self.cadence.batch_step

    @property
    def measuring(self) -> bool:
        """Return whether the running batch belongs to a logging step, with the hooks on."""
        return self._state.measuring and self._state.attached is not None

    def start_fit(self, trainer: TrainerView, guard: Guard, *, watching: bool) -> None:
        """Start a fit with a new guard, and check the Trainer if the callback watches.

        Args:
            trainer: the trainer of the fit.
            guard: the fit's guard, with no failure.
            watching: ``False`` where a callback the user passed already watches the model.
        """
        self._state = self._new_fit(guard, watching=watching)
        self.checkpoint.drop_failed_fit()  # kept by the last fit, if it failed
        if watching:
            check_trainer(
                self.owner,
                trainer,
                uses_images=self.uses_images,
                every_n_steps=self.every_n_steps,
            )

    def start_training(self) -> bool:
        """Remove the hooks an earlier fit left and start the ranks' agreement, at train start.

        The ranks' agreement counts the fit's processes.

        Returns:
            Whether the callback watches the model: then it attaches its hooks.
        """
        self.remove_hooks()
        self.ranks.start()
        return self._state.watching

    def attach(self, attached: Attached) -> None:
        """Keep what the fit put on the model, and load a checkpoint held for it, if any.

        Args:
            attached: the hooks and statistics the callback put on the model for this fit.
        """
        self._state.attached = attached
        self._state.restored_epoch = self.checkpoint.restore(attached)

    def start_batch(self, trainer: TrainerView, batch_idx: int) -> bool:
        """Start a batch: log the values that reached the host, and put the hooks on or off.

        It also has the loggers save what was written up to now, so that a run killed in this
        batch keeps it. With several of the library's callbacks, the first one here flushes for all.

        Args:
            trainer: the trainer running the batch.
            batch_idx: the batch's index in its epoch.

        Returns:
            Whether the batch is measured: it belongs to a logging step and the fit's module
            hooks are on the model.
        """
        logging_step = self.cadence.start_batch(trainer, batch_idx)
        attached = self._state.attached
        restored = self._state.restored_epoch
        self._state.restored_epoch = None
        if attached is not None and rolls_over(restored, trainer.current_epoch):
            self.checkpoint.start_new_epoch(attached)
        if attached is not None:
            attached.write_arrived_steps(trainer)  # on CUDA, the last logging step's copy
        self._hooks_for_logging_step(logging_step)
        save_loggers(trainer.loggers, layout=trainer.is_global_zero)
        self._state.measuring = logging_step and attached is not None
        if self._state.measuring:
            self.cadence.measure()
        return self._state.measuring

    def end_batch(self, trainer: TrainerView) -> int | None:
        """End a batch, and write its logging step if its optimizer step has run.

        The ranks agree first; on a failure the callback is disabled on every rank and nothing
        is written. The module hooks are then removed unless the next step is a logging step
        too, so a step that is not a logging step runs none of the library's module hooks.

        Args:
            trainer: the trainer running the batch, whose loggers get the logging step.

        Returns:
            The logging step whose values were written or copied to the host, or ``None``.
        """
        step = self.cadence.finished_step(trainer)
        attached = self._state.attached  # a failure in the batch's hooks may have removed it
        if step is None or attached is None:
            return None
        self.ranks.agree(trainer, step, attached, always=False)
        if self.guard.failed is not None:
            return None
        attached.end_logging_step(trainer, step)
        self._hooks_for_logging_step(self.cadence.logs(trainer, trainer.global_step))
        return step

    def _hooks_for_logging_step(self, logging_step: bool) -> None:
        """Put the fit's gated module hooks on the model for a logging step, else remove them.

        The registry is told only when the answer changes, so a step that is not a logging step
        after another one only reads a flag.
        """
        attached = self._state.attached
        registry = None if attached is None else attached.registry
        if registry is not None and registry.logging_step != logging_step:
            registry.set_logging_step(logging_step)

    def end_epoch(self, trainer: TrainerView) -> bool:
        """Log each statistic's epoch aggregates once the processes agree, then flush the loggers.

        Args:
            trainer: the trainer ending the epoch, whose loggers get its values.

        Returns:
            Whether the fit is still attached (its module hooks on the model), so that the
            callback closes its epoch too. It then saves the loggers again after what it
            writes.
        """
        self.ranks.agree(trainer, trainer.global_step, self._state.attached, always=True)
        self.cadence.end_epoch()
        attached = self._state.attached  # a failure the ranks agreed on removes it
        if attached is not None:
            attached.write_steps(trainer, wait=True)
            attached.write_epoch(trainer)  # each statistic's epoch, then the next one starts
        save_loggers(trainer.loggers)  # the chart layout waits for the next batch's save
        return attached is not None

    def end_training(self, trainer: TrainerView) -> None:
        """End the fit's training, and remove its module hooks.

        What is still pending is written (a Fabric loop may end without an epoch end before
        it) and the loggers are saved (:meth:`flush`); then the ranks agree on a failure after
        the last epoch end.

        Args:
            trainer: the trainer ending the fit.
        """
        try:
            self.flush(trainer)
            if self.guard.failed is None:
                self.ranks.agree(trainer, trainer.global_step, self._state.attached, always=True)
        finally:
            self.remove_hooks()

    def flush(self, trainer: TrainerView) -> None:
        """Write what was measured before the hooks go, then save the loggers.

        On CUDA this waits for the last logging step's copy. ``on_exception`` calls it, and
        :meth:`end_training`.

        Args:
            trainer: the trainer whose loggers get what is pending.
        """
        attached = self._state.attached
        if attached is not None:
            attached.write_steps(trainer, wait=True)
        save_loggers(trainer.loggers, layout=trainer.is_global_zero)

    def keep_failed_fit(self) -> None:
        """Keep the running fit's statistics for a checkpoint saved after its failure.

        In one process only: their state is reduced across ranks, and a collective made on the
        failing rank alone would hang it.
        """
        if self.ranks.size == 1:
            self.checkpoint.keep_failed_fit(self._state.attached, self.cadence.epoch)

    def remove_hooks(self) -> None:
        """Take every hook and statistic of the running fit off the model.

        Calling it again does nothing; the guard calls it after a failure.
        """
        attached = self._state.attached
        self._state.attached = None
        if attached is not None:
            attached.remove()

    def state_dict(self) -> dict[str, Any]:
        """Return the callback's checkpoint state, with the layers of every process."""
        attached = self._state.attached
        if attached is not None and self.ranks.size > 1 and attached.aligned:
            attached.align_rows()  # include the rows made since the last logging step
        return self.checkpoint.save(attached, epoch=self.cadence.epoch)
