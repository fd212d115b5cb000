"""The lifecycle every callback shares: attach in ``on_train_start``, detach on every exit."""

from __future__ import annotations

import pytorch_lightning as pl
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities import rank_zero_warn
from typing_extensions import override

from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.logging import tensorboard_writers, write_dashboard

__all__ = ["HookCallback"]


class HookCallback(pl.Callback):
    """Base of the library's callbacks: owns when hooks exist, subclasses own what they measure.

    Hooks are registered in ``on_train_start`` (after the sanity check) and removed in
    ``on_train_end``, ``on_exception`` and ``teardown``: Lightning runs neither of the last two
    hooks' siblings after an exception, so each of them removes, idempotently. A second ``fit``
    starts from a clean slate. Subclasses implement :meth:`_attach`, :meth:`_detach` and
    :meth:`_log_epoch`.
    """

    uses_images: bool = True

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
        if trainer.is_global_zero and self._is_last_hook_callback(trainer):
            # One layout per run, covering every callback's tags: written by the last of ours.
            write_dashboard(tensorboard_writers(trainer.loggers))

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

    def _is_last_hook_callback(self, trainer: pl.Trainer) -> bool:
        ours = [cb for cb in trainer.callbacks if isinstance(cb, HookCallback)]  # type: ignore[attr-defined]
        return not ours or ours[-1] is self

    def _validate(self, pl_module: pl.LightningModule) -> None:
        """Check the configuration against the model before training starts."""

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    def _detach(self) -> None:
        raise NotImplementedError

    def _log_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError
