"""Which optimizer steps a callback measures, and the per-batch body written once for all.

:class:`Cadence` is the top of the three pieces of
:class:`~lightning_hooks.callbacks._base.HookCallback` (lifecycle, writing, cadence): it sets the
sampled-step gate before each batch and, after the measured step's optimizer step, makes it a
logging point. Subclasses extend the two per-batch hooks through :meth:`Cadence._batch_started`
and :meth:`Cadence._batch_ending` instead of overriding them.
"""

from __future__ import annotations

from typing import Any, Protocol

import pytorch_lightning as pl
from typing_extensions import override

from lightning_hooks.callbacks._writing import Writing

__all__ = ["Cadence"]


class _Gate(Protocol):
    sampled: bool


class Cadence(Writing):
    """The sampled-step gate and the logging points (see :attr:`every_n_steps`)."""

    every_n_steps: int | None = None
    """Cadence: measure optimizer steps ``n-1, 2n-1, ...`` (the steps at which Lightning logs
    ``self.log`` values when ``n`` is ``log_every_n_steps``) and the first step of every epoch
    (1: every step; ``None``: the Trainer's ``log_every_n_steps``, 50 by default). Each measured
    step is a logging point: its values are written at that step, under ``..._step`` tags.
    Off-sample steps run no module hook of ours (under ``torch.compile``: an attribute check
    per hook, the hook set staying fixed); epoch aggregates are then over the
    sampled steps, and an epoch shorter than ``n`` steps still has one."""
    _epoch_start_step: int = -1

    def _cadence(self, trainer: pl.Trainer) -> int:
        """The resolved ``every_n_steps``."""
        # An attribute Lightning sets at init, not declared on the class.
        return self.every_n_steps or max(1, int(getattr(trainer, "log_every_n_steps", 50)))

    def _is_sampled_step(self, trainer: pl.Trainer) -> bool:
        """Whether the optimizer step about to run (``trainer.global_step``) is measured."""
        step = trainer.global_step
        return (step + 1) % self._cadence(trainer) == 0 or step == self._epoch_start_step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == 0:
            # By batch index, not on_train_epoch_start: a run resumed mid-epoch samples the
            # same steps as the uninterrupted one. Every micro-batch of the step follows.
            self._epoch_start_step = trainer.global_step
        self._read_steps(trainer, wait=False)  # on CUDA, the last logging point's copy
        sampled = self._is_sampled_step(trainer)
        if sampled and self._tracker is not None:
            self._measured_step = trainer.global_step
        gate: _Gate | None = getattr(self._tracker, "registry", None)
        if gate is not None:
            gate.sampled = sampled
        self._end_round(trainer)
        self._batch_started(trainer)

    def _batch_started(self, trainer: pl.Trainer) -> None:
        """Extend: the last of ``on_train_batch_start``, once this step's gate is set."""

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self._batch_ending(trainer, outputs):
            return
        measured = self._measured_step
        if measured is not None and trainer.global_step > measured:
            # The measured step's optimizer step ran (its last micro-batch): a logging point.
            # The last one's copy (CUDA: posted a step or more ago) is written first.
            self._measured_step = None
            if self._agree(trainer, measured):
                return
            self._read_steps(trainer, wait=True)
            self._log_step(trainer, measured)
            self._posted = True
            self._read_steps(trainer, wait=False)
        self._end_round(trainer)

    def _batch_ending(self, trainer: pl.Trainer, outputs: Any) -> bool:
        """Extend: the first of ``on_train_batch_end`` (``outputs``: the training step's);
        ``True`` when the callback was disabled there, and the hook ends."""
        return False
