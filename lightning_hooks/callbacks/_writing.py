"""What a callback writes and when its loggers are saved: logging steps, epoch ends, the dashboard.

:class:`Writing` is the middle of the three pieces of
:class:`~lightning_hooks.callbacks._base.HookCallback` (lifecycle, writing, cadence).
"""

from __future__ import annotations

import weakref

import pytorch_lightning as pl
from typing_extensions import override

from lightning_hooks.callbacks._lifecycle import Lifecycle
from lightning_hooks.logging import save_loggers, write_dashboards

__all__ = ["Writing"]

_UNSAVED: weakref.WeakSet[pl.Trainer] = weakref.WeakSet()
"""The trainers whose loggers one of our callbacks wrote to since they were last saved."""


class Writing(Lifecycle):
    """Writes the logging steps once their host copies are done and each epoch at its end, saves
    the loggers once per hook round for all of our callbacks, and writes the dashboard."""

    _measured_step: int | None = None
    _posted = False  # a logging point's windows were posted, and may not all be written yet

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._agree(trainer, trainer.global_step, always=True):
            return
        self._read_steps(trainer, wait=True)
        self._measured_step = None
        self._log_epoch(trainer, pl_module)
        self._write_dashboard(trainer)
        save_loggers(trainer.loggers)
        _UNSAVED.discard(trainer)

    def _write_dashboard(self, trainer: pl.Trainer) -> None:
        if trainer.is_global_zero and self._is_last_hook_callback(trainer):
            # One layout per run, covering every callback's tags: written by the last of ours.
            write_dashboards(trainer.loggers)

    def _read_steps(self, trainer: pl.Trainer, wait: bool) -> None:
        """Write what the last logging point measured once its host copy is done (``wait``:
        block for it); the loggers are saved at the end of the hook round (:meth:`_end_round`).
        Without ``wait``, nothing is looked at unless a logging point posted a window that is
        not yet written (a quiet step's hooks cost no read of each statistic's mailbox)."""
        if not (wait or self._posted):
            return
        if self._write_steps(trainer, wait):
            _UNSAVED.add(trainer)
        self._posted = not wait and self._steps_in_flight()

    def _end_round(self, trainer: pl.Trainer) -> None:
        """Save the loggers once per per-batch hook when any of ours wrote in it.

        Lightning saves its loggers after each ``log_metrics``, so what was written survives a
        SIGKILL; a save flushes the event file and waits for TensorBoard's writer thread. With
        several of our callbacks writing at the same step, each saving would cost one flush per
        callback: the last of ours still running (its guard not failed) saves for all, at the
        end of its hook. A callback that fails mid-hook leaves its write unsaved until the next
        round, whose last live callback saves it. A quiet step costs one set lookup.
        """
        if trainer not in _UNSAVED:
            return
        live = [
            cb
            for cb in trainer.callbacks  # type: ignore[attr-defined]
            if isinstance(cb, Writing) and cb._hook_guard().failed is None
        ]
        if not live or live[-1] is self:
            self._save(trainer)

    def _save(self, trainer: pl.Trainer) -> None:
        """Write the dashboard (rank 0) and save the loggers if any of ours wrote since."""
        if trainer not in _UNSAVED:
            return
        _UNSAVED.discard(trainer)
        if trainer.is_global_zero:
            write_dashboards(trainer.loggers)
        save_loggers(trainer.loggers)

    @override
    def _flush(self, trainer: pl.Trainer) -> None:
        self._read_steps(trainer, wait=True)  # CUDA: the last logging step's copy
        self._save(trainer)

    def _is_last_hook_callback(self, trainer: pl.Trainer) -> bool:
        ours = [cb for cb in trainer.callbacks if isinstance(cb, Writing)]  # type: ignore[attr-defined]
        return not ours or ours[-1] is self

    def _log_step(self, trainer: pl.Trainer, step: int) -> None:
        """A logging point: end the window of the steps measured since the last one (post its
        one host copy); :meth:`_write_steps` writes it at ``step`` once the copy is done."""

    def _write_steps(self, trainer: pl.Trainer, wait: bool) -> bool:
        """Write the windows whose copies are done (``wait``: block for them); whether any was.
        A callback that overrides it overrides :meth:`_steps_in_flight` too."""
        return False

    def _steps_in_flight(self) -> bool:
        """Whether a window :meth:`_log_step` posted is not yet written."""
        return False

    def _log_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError
