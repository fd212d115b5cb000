"""Which optimizer steps a callback measures, and the step that the current batch belongs to."""

from __future__ import annotations

from lightning_hooks.callbacks.trainer import FitProgress
from lightning_hooks.core.checks import positive_int_or_none

__all__ = ["LIGHTNING_LOG_EVERY_N_STEPS", "LoggingCadence", "check_every_n_steps"]


def check_every_n_steps(owner: str, every_n_steps: int | None) -> int | None:
    """Return ``every_n_steps`` unchanged if it is a positive int or ``None``.

    Args:
        owner: the callback's name, which the error begins with.
        every_n_steps: the cadence in optimizer steps; ``None`` means ``log_every_n_steps``.

    Raises:
        ValueError: ``every_n_steps`` is neither a positive int nor ``None``.

    Example:
        >>> check_every_n_steps("GradFlowCallback", 10)
        10
    """
    meaning = "the Trainer's log_every_n_steps"
    return positive_int_or_none(owner, "every_n_steps", every_n_steps, none_means=meaning)


LIGHTNING_LOG_EVERY_N_STEPS = 50
"""The Trainer's default ``log_every_n_steps``: the cadence where neither the callback nor the
trainer names one (a Fabric loop has no Trainer to name it)."""


class LoggingCadence:
    """Decides which optimizer steps a callback measures.

    The logging steps (see docs/glossary.md) are optimizer steps ``n-1, 2n-1, ...`` plus the
    first step of each epoch. Under gradient accumulation, every micro-batch of a logging step
    belongs to it, and its values are written once its optimizer step has run. The epoch's
    first step is found from the batch index, not in ``on_train_epoch_start``, so a run resumed
    mid-epoch measures the same steps as one never interrupted. A batch that steps several
    optimizers (manual optimization) is measured when one of its steps is a logging step, and
    its values are written at its first step.

    Args:
        every_n_steps: ``n``; ``None`` uses the Trainer's ``log_every_n_steps``.

    Example:
        >>> from types import SimpleNamespace
        >>> cadence = LoggingCadence(every_n_steps=3)
        >>> trainer = SimpleNamespace(global_step=0, current_epoch=0, log_every_n_steps=50)
        >>> logs = []
        >>> for step in range(4):  # one batch a step: the epoch's first, then steps 2, 5, ...
        ...     trainer.global_step = step
        ...     logs.append(cadence.start_batch(trainer, batch_idx=step))
        >>> logs
        [True, False, True, False]
    """

    def __init__(self, every_n_steps: int | None) -> None:
        self.every_n_steps = every_n_steps
        self.batch_step = 0
        """The optimizer step the running batch feeds."""
        self.epoch_start_step = -1
        self.epoch: int | None = None
        """The epoch of the running batch (``None`` before the fit's first batch)."""
        self.measured_step: int | None = None
        """The logging step being measured, until its values are handed over to be written."""
        self.steps_per_batch = 1
        """The optimizer steps of the last batch that stepped: one, or one per optimizer where
        several step in a batch (manual optimization)."""

    def logs(self, trainer: FitProgress, step: int) -> bool:
        """Return whether the batch starting at optimizer step ``step`` holds a logging step.

        It does when one of the :attr:`steps_per_batch` optimizer steps it takes is a logging
        step by the cadence alone: with one step a batch, when ``step`` itself is.

        Args:
            trainer: the trainer, whose ``log_every_n_steps`` is the cadence where
                ``every_n_steps`` is ``None``.
            step: the optimizer step the batch starts at.
        """
        # Lightning sets log_every_n_steps on its Trainer; no protocol of ours declares it.
        every = getattr(trainer, "log_every_n_steps", LIGHTNING_LOG_EVERY_N_STEPS)
        cadence = self.every_n_steps or max(1, int(every))
        return (step + self.steps_per_batch) // cadence > step // cadence

    def start_batch(self, trainer: FitProgress, batch_idx: int) -> bool:
        """Record a batch's start, and return whether it belongs to a logging step.

        ``batch_idx`` 0 marks the epoch's first step.

        Args:
            trainer: the trainer, whose ``global_step`` the batch feeds.
            batch_idx: the batch's index in its epoch.
        """
        self.batch_step = trainer.global_step
        self.epoch = trainer.current_epoch
        if batch_idx == 0:
            self.epoch_start_step = self.batch_step
        return self.logs(trainer, self.batch_step) or self.batch_step == self.epoch_start_step

    def measure(self) -> None:
        """Mark the running batch's logging step as measured."""
        self.measured_step = self.batch_step

    def end_epoch(self) -> None:
        """Stop measuring any logging step at the end of an epoch.

        If a skipped batch cut a logging step short, that step is not written.
        """
        self.measured_step = None

    def finished_step(self, trainer: FitProgress) -> int | None:
        """Record a batch's end, and return the logging step whose optimizer step has just run.

        Args:
            trainer: the trainer, whose ``global_step`` says whether the step has run.

        Returns:
            That step, once only. ``None`` for a quiet step, and for each micro-batch before a
            step's last one.
        """
        stepped = trainer.global_step - self.batch_step
        if stepped > 0:  # a micro-batch before its step's last one steps nothing
            self.steps_per_batch = stepped
        measured = self.measured_step
        if measured is None or trainer.global_step <= measured:
            return None
        self.measured_step = None
        return measured
