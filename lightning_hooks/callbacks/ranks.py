"""What the ranks of a multi-process fit agree on, so that every rank acts alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lightning_hooks.callbacks.attached import Attached
from lightning_hooks.callbacks.trainer import TrainerView
from lightning_hooks.core.distributed import agree, gather_objects, world_size
from lightning_hooks.core.hooks.guard import Guard

__all__ = ["RankAgreement"]


class RankAgreement:
    """Makes every rank of a multi-process fit act alike on a callback's failure, stop and rows.

    Three things must be the same on every rank, or one rank would wait forever in a collective
    that the others skip (guard, row and logging step: see docs/glossary.md):

    - **A failure.** A hook's failure on one rank is held by its guard until the ranks agree;
      then the callback is disabled on every rank, with one warning.
    - **A stop.** An alarm's ``stop`` on one rank waits for the same agreement, so every rank
      stops after the same step.
    - **New rows.** A module that runs on only some ranks makes its rows there alone. The rows
      are put in one order on every rank before they are reduced.

    The ranks agree at each logging step and each epoch end, in one small collective. A
    callback that already runs a collective at every batch, such as the loss mean of
    :mod:`.loss_agreement`, carries the flags in it and passes their sums to :meth:`apply`; that
    logging step then needs no collective of its own. With one process nothing is exchanged.

    Args:
        guard: the guard of the fit; each fit has its own, and its own agreement.
        remove_hooks: removes the callback's module hooks once it is disabled.

    Example:
        >>> guard = Guard("Cb", strict=False)
        >>> ranks = RankAgreement(guard, remove_hooks=lambda: None)
        >>> ranks.start()  # at a fit's train start: one process
        >>> from types import SimpleNamespace
        >>> trainer = SimpleNamespace(should_stop=False)
        >>> ranks.request_stop(trainer)  # with one process: at once
        >>> trainer.should_stop
        True
    """

    def __init__(self, guard: Guard, remove_hooks: Callable[[], None]) -> None:
        self._guard = guard
        self._remove_hooks = remove_hooks
        self.size = 1
        """How many processes the fit runs on (counted at its train start)."""
        self.stop_requested = False
        """This rank's request to stop the fit, until the ranks agree on it."""
        self._agreed_at: int | None = None

    def start(self) -> None:
        """Count the ranks at a fit's train start, and forget the last fit's requests.

        Under several ranks the guard holds a failure until they agree, unless it is strict:
        a strict guard raises at once on each rank that fails.
        """
        guard = self._guard
        self.size = world_size()
        self.stop_requested = False
        self._agreed_at = None
        guard.defer = not guard.strict and self.size > 1

    def request_stop(self, trainer: TrainerView) -> None:
        """Stop the fit: at once in one process; under several, once the ranks agree on it.

        The ranks agree in a collective the callback makes anyway (no host sync of its own).

        Args:
            trainer: the trainer, whose ``should_stop`` is set (in one process, now).
        """
        if self.size == 1:
            trainer.should_stop = True
        else:
            self.stop_requested = True

    @property
    def failed_here(self) -> bool:
        """Return whether this rank has a hook failure that the ranks have not yet agreed on."""
        return self._guard.local is not None

    def agree(
        self, trainer: TrainerView, step: int, attached: Attached | None, *, always: bool
    ) -> None:
        """Agree on a failure, a stop and new rows, at a logging step or an epoch end.

        Args:
            trainer: stopped if a rank asked to stop; its rank 0 warns of a failure.
            step: the optimizer step the ranks agree at, named in a failure's warning.
            attached: what the running fit attached, whose statistics' rows are aligned.
                ``None`` if nothing is attached or the callback is disabled.
            always: agree even if the ranks already agreed at ``step`` through :meth:`apply`.
                An epoch end passes ``True``, so that the rows are aligned there too.
        """
        guard = self._guard
        agreed = self._agreed_at == step and not always
        if self.size == 1 or guard.failed is not None or agreed:
            return
        rows_grew = attached is not None and attached.rows_grew()
        failed, stopping, grew = agree([self.failed_here, self.stop_requested, rows_grew])
        disabled = self._act(trainer, step, failed=failed, stopping=stopping)
        if grew and attached is not None and not disabled:
            self._align_rows(trainer, step, attached)

    def apply(self, trainer: TrainerView, step: int, *, failed: int, stopping: int) -> bool:
        """Act on the flags a callback's own per-batch collective summed over the ranks.

        After this call the ranks count as agreed at ``step``, so :meth:`agree` makes no
        collective there.

        Args:
            trainer: the trainer whose ``should_stop`` is set where a rank asked to stop.
            step: the optimizer step of the batch whose collective carried the flags.
            failed: how many ranks failed.
            stopping: how many ranks asked to stop.

        Returns:
            Whether a failure disabled the callback (its hooks are then off on every rank).
        """
        self._agreed_at = step
        return self._act(trainer, step, failed=failed, stopping=stopping)

    def _act(self, trainer: TrainerView, step: int, *, failed: int, stopping: int) -> bool:
        """Stop if any rank asked, and disable the callback on every rank if any failed.

        Returns:
            Whether a failure disabled the callback.
        """
        if stopping:
            trainer.should_stop = True
            self.stop_requested = False
        if failed:
            self._disable(trainer, step, gather_objects(self._guard.local))
        return bool(failed)

    def _align_rows(self, trainer: TrainerView, step: int, attached: Attached) -> None:
        """Align the ranks' rows of the fit's statistics.

        If a layer's units differ between ranks, the callback is disabled on every rank. A
        strict guard raises the error instead.

        Raises:
            ValueError: a layer's units differ between ranks and the guard is strict.
        """
        try:
            attached.align_rows()
        except ValueError as error:
            if self._guard.strict:
                raise
            cause = f"aligning rows across ranks: {type(error).__name__}: {error}"
            self._disable(trainer, step, [cause] * self.size)  # the same cause for every rank

    def _disable(self, trainer: TrainerView, step: int, causes: Sequence[str | None]) -> None:
        """Disable the callback on every rank, with one warning on rank 0 naming each cause.

        ``causes`` holds each rank's cause by rank, ``None`` for a rank that did not fail.
        """
        guard = self._guard
        guard.disable_on_every_rank(causes, step, warn=trainer.is_global_zero)
        guard.removal_due()
        self._remove_hooks()
