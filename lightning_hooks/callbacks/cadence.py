"""Decide which optimizer steps a callback measures, and keep where the running one is."""

from __future__ import annotations

from lightning_hooks.callbacks.trainer import TrainerView
from lightning_hooks.core.checks import positive_int_or_none

__all__ = ["LoggingCadence", "check_every_n_steps"]


def check_every_n_steps(owner: str, every_n_steps: int | None) -> int | None:
    """Check that a cadence is a positive int or ``None``.

    Args:
        owner: the callback's name, which the error begins with.
        every_n_steps: the cadence the user gave (``None``: the Trainer's
            ``log_every_n_steps``).

    Returns:
        ``every_n_steps``, unchanged.

    Raises:
        ValueError: ``every_n_steps`` is neither a positive int nor ``None``.

    Example:
        >>> check_every_n_steps("GradFlowCallback", 10)
        10
    """
    meaning = "the Trainer's log_every_n_steps"
    return positive_int_or_none(owner, "every_n_steps", every_n_steps, none_means=meaning)


class LoggingCadence:
    """Decide a callback's logging steps from its cadence and the epochs' first steps.

    The logging steps are every ``every_n_steps``-th optimizer step (steps ``n-1, 2n-1, ...``;
    ``None``: the Trainer's ``log_every_n_steps``) and each epoch's first.
    Every micro-batch of a logging step belongs to it, and its values are written once its
    optimizer step has run. An epoch's first step is found by the batch index, not at
    ``on_train_epoch_start``, so that a run resumed mid-epoch measures the steps the
    uninterrupted one measures.

    Args:
        every_n_steps: the cadence, or ``None`` for the Trainer's.

    Example:
        >>> from types import SimpleNamespace
        >>> cadence = LoggingCadence(every_n_steps=3)
        >>> trainer = SimpleNamespace(global_step=0, log_every_n_steps=50)
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
        """The optimizer step of the running epoch's first batch."""
        self.measuring: int | None = None
        """The logging step being measured, until its values are taken to be written."""

    def logs(self, trainer: TrainerView, step: int) -> bool:
        """Tell whether an optimizer step is a logging step by the cadence alone.

        Args:
            trainer: the trainer, whose ``log_every_n_steps`` is the cadence where none is set.
            step: the optimizer step asked about.

        Returns:
            Whether ``step`` is a logging step.
        """
        every = getattr(trainer, "log_every_n_steps", 50)  # set by Lightning, not typed
        cadence = self.every_n_steps or max(1, int(every))
        return (step + 1) % cadence == 0

    def start_batch(self, trainer: TrainerView, batch_idx: int) -> bool:
        """Note a batch's start, and tell whether it belongs to a logging step.

        Args:
            trainer: the trainer, whose ``global_step`` is the step the batch feeds.
            batch_idx: the batch's index in its epoch (0 marks the epoch's first step).

        Returns:
            Whether the batch belongs to a logging step.
        """
        self.batch_step = trainer.global_step
        if batch_idx == 0:
            self.epoch_start_step = self.batch_step
        return self.logs(trainer, self.batch_step) or self.batch_step == self.epoch_start_step

    def measure(self) -> None:
        """Mark the running batch's logging step as measured."""
        self.measuring = self.batch_step

    def end_epoch(self) -> None:
        """Stop measuring any logging step at an epoch's end.

        A step cut short by a skipped batch is dropped.
        """
        self.measuring = None

    def finished_step(self, trainer: TrainerView) -> int | None:
        """Note a batch's end, and return the logging step whose optimizer step has just run.

        Args:
            trainer: the trainer, whose ``global_step`` has moved past the measured step once its
                optimizer step ran.

        Returns:
            The logging step whose optimizer step has just run, once; else ``None`` (a quiet
            step, or a micro-batch before its step's last).
        """
        measured = self.measuring
        if measured is None or trainer.global_step <= measured:
            return None
        self.measuring = None
        return measured
