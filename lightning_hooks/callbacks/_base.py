"""The lifecycle every callback shares: attach in ``on_train_start``, detach on every exit."""

from __future__ import annotations

import pytorch_lightning as pl
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities import rank_zero_warn
from typing_extensions import override

from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.logging import tensorboard_writers

__all__ = ["HookCallback", "check_every_n_steps"]


def check_every_n_steps(owner: str, every_n_steps: int) -> int:
    """Validate a cadence argument: a positive int, named with its owner in the error.

    Example:
        >>> check_every_n_steps("GradFlowCallback", 4)
        4
    """
    if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
        raise ValueError(
            f"{owner}(every_n_steps={every_n_steps!r}): must be a positive int, "
            f"got {every_n_steps!r}"
        )
    return every_n_steps


class HookCallback(pl.Callback):
    """Base of the library's callbacks: owns when hooks exist, subclasses own what they measure.

    Hooks are registered in ``on_train_start`` (after the sanity check) and removed in
    ``on_train_end``, ``on_exception`` and ``teardown``: Lightning runs neither of the last two
    hooks' siblings after an exception, so each of them removes, idempotently. A second ``fit``
    starts from a clean slate. Subclasses implement :meth:`_attach`, :meth:`_detach` and
    :meth:`_log_epoch`.
    """

    uses_images: bool = True
    every_n_steps: int = 1
    """Cadence: measure on optimizer steps ``0, n, 2n, ...`` only (1: every step). Off-sample
    steps cost a Python int check per hook; statistics are then means over the sampled steps."""

    def _is_sampled_step(self, trainer: pl.Trainer) -> bool:
        """Whether the optimizer step about to run (``trainer.global_step``) is measured."""
        return trainer.global_step % self.every_n_steps == 0

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        name = type(self).__name__
        if not trainer.loggers:
            raise MisconfigurationException(
                f"{name} needs a logger, but the Trainer has none (logger=False). "
                "Use Trainer(logger=TensorBoardLogger(...)) or leave logger at its default."
            )
        if self.uses_images and not tensorboard_writers(trainer.loggers):
            rank_zero_warn(
                f"{name}: no TensorBoardLogger among the Trainer's loggers; scalars go to "
                f"{[type(lg).__name__ for lg in trainer.loggers]}, images need TensorBoard.",
                category=LightningHooksWarning,
            )
        self._validate(pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()
        self._attach(trainer, pl_module)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_epoch(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._detach()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._detach()

    def _validate(self, pl_module: pl.LightningModule) -> None:
        """Check the configuration against the model before training starts."""

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    def _detach(self) -> None:
        raise NotImplementedError

    def _log_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError
