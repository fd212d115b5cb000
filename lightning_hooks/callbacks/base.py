"""The base class of every callback: what the callbacks share, held as collaborators.

The methods a Fabric loop calls on a callback are in :class:`~.fabric.FabricHooks`, from which
the base derives.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.fabric import FabricHooks
from lightning_hooks.callbacks.lifecycle import Lifecycle
from lightning_hooks.callbacks.trainer import (
    SECOND_CALLBACK,
    TrainerView,
    defers_to_users_own,
    restore_inherited,
    skip_inherited,
)
from lightning_hooks.core.hooks.guard import Guard, guarded
from lightning_hooks.internals.lightning import drop_model_logging
from lightning_hooks.switch import state_key_fields

__all__ = ["HookCallback"]

# Lightning ships under two names, ``pytorch_lightning`` and ``lightning.pytorch``. Each
# namespace's LightningCLI accepts only its own ``Callback``, so the base derives from both
# where both are installed. To the type checker, ``lightning.pytorch.Callback`` is ``object``.
if TYPE_CHECKING:
    _SecondCallback = object
else:
    _SecondCallback = SECOND_CALLBACK


class HookCallback(FabricHooks, pl.Callback, _SecondCallback):
    """What every callback shares: its lifecycle, its guard, its checkpoint key and Fabric's hooks.

    A callback holds a :class:`~.lifecycle.Lifecycle` as :attr:`lifecycle`, and defines its own
    Lightning hooks for what it measures, each calling the lifecycle and the callback's own
    collaborators by name: ``on_fit_start`` (check the model), ``on_train_start`` (attach),
    ``on_train_batch_start``, ``on_train_batch_end`` and ``on_train_epoch_end``. The base
    defines the hooks that are the same for every callback: ``setup``, ``on_train_end``,
    ``on_exception``, ``teardown``, ``state_dict`` and ``load_state_dict``. A callback
    overrides none of them, and the base calls no method of a callback.

    Every Lightning hook that runs during training is decorated with ``@guarded``, in the base
    and in each callback: an error in the library's own code disables the callback for the rest
    of the fit, with one warning, and never ends the run. ``setup`` and ``on_fit_start`` are
    not, because a configuration error must stop the fit before it trains, and neither is
    ``load_state_dict``, which only holds the state until the fit attaches.

    Every exit of a fit (``on_train_end``, ``on_exception``, ``teardown``, a failure) takes the
    module hooks; docs/architecture.md lists what each does.

    Example:
        >>> import pytorch_lightning as pl
        >>> from lightning_hooks.callbacks.attached import Logged
        >>> from lightning_hooks.callbacks.watching import attach_stats
        >>> from lightning_hooks.core.hooks.guard import guarded
        >>> from lightning_hooks.core.stats.activation_stats import ActivationStatsTracker
        >>> class Activations(HookCallback):
        ...     def __init__(self):
        ...         self.tracker = ActivationStatsTracker(owner="Activations")
        ...         super().__init__(state_key={"stats": [self.tracker.config_key()]})
        ...     @guarded
        ...     def on_train_start(self, trainer, pl_module):
        ...         if self.lifecycle.start_training():
        ...             logged = [Logged(self.tracker)]
        ...             self.lifecycle.attach(attach_stats(pl_module, self.hook_guard(), logged))
        ...     @guarded
        ...     def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        ...         self.lifecycle.start_batch(trainer, batch_idx)
        ...     @guarded
        ...     def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        ...         self.lifecycle.end_batch(trainer)
        ...     @guarded
        ...     def on_train_epoch_end(self, trainer, pl_module):
        ...         self.lifecycle.end_epoch(trainer)
        >>> Activations().every_n_steps is None  # the Trainer's log_every_n_steps
        True
        >>> trainer = pl.Trainer(callbacks=[Activations()])  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        state_key: Mapping[str, Any],
        every_n_steps: int | None = None,
        uses_images: bool = False,
        fabric_refusal: str | None = None,
    ) -> None:
        """Set the cadence, the checkpoint key, and the state every fit starts from.

        Args:
            state_key: the fields that tell this configuration's checkpoint state apart from
                another's (Lightning refuses two callbacks with one key).
            every_n_steps: the cadence of the logging steps (see :class:`~.cadence.LoggingCadence`).
            uses_images: whether the callback draws pictures. A logger that cannot show them
                triggers one warning.
            fabric_refusal: why this configuration cannot run in a Fabric loop, or ``None``.
                A Fabric run refuses the callback with this reason at ``fabric.setup``.

        Raises:
            ValueError: ``every_n_steps`` is not a positive int or ``None``.
        """
        super().__init__(fabric_refusal=fabric_refusal)
        self._state_key_fields = dict(state_key)
        self.strict: bool | None = None
        """Whether a hook's exception is raised (``True``) or disables the callback for the rest
        of the fit (``False``). ``None``: the ``LIGHTNING_HOOKS_STRICT`` environment variable
        decides. Each fit's ``setup`` reads it."""
        self._from_environment = False
        self._state_key = self._generate_state_key(**self._state_key_fields)
        self._shadowed_hooks: tuple[str, ...] = ()
        """The inherited per-batch hooks Lightning skips in this fit (see
        :func:`~.trainer.skip_inherited`)."""
        self.lifecycle = Lifecycle(
            type(self).__name__,
            self._new_guard(),
            every_n_steps=every_n_steps,
            uses_images=uses_images,
        )
        """Runs what every callback does in each fit; the callback's hooks call it."""

    @property
    def every_n_steps(self) -> int | None:
        """Return the cadence of the logging steps; ``None`` means ``log_every_n_steps``."""
        return self.lifecycle.every_n_steps

    def hook_guard(self) -> Guard:
        """Return the guard of this fit's hooks.

        Its ``failed`` says whether the callback is disabled, and why.
        """
        return self.lifecycle.guard

    def _new_guard(self) -> Guard:
        """Make a guard with no failure, strict as :attr:`strict` says."""
        return Guard(type(self).__name__, strict=self.strict)

    @property
    def uses_images(self) -> bool:
        """Deprecated: release 0.2.0's name of whether the callback draws pictures."""
        warnings.warn(
            f"{type(self).__name__}.uses_images is deprecated: read callback.lifecycle.uses_images",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.lifecycle.uses_images

    def flush(self, trainer: TrainerView) -> None:
        """Deprecated: write what was measured and save the loggers, as release 0.2.0 did.

        The end of training and ``on_exception`` write it themselves, under Fabric too.

        Args:
            trainer: the trainer whose loggers get what is pending.
        """
        warnings.warn(
            f"{type(self).__name__}.flush(trainer) is deprecated: the end of training writes "
            "what is pending, and callback.lifecycle.flush(trainer) does it at any time",
            DeprecationWarning,
            stacklevel=2,
        )
        self.lifecycle.flush(trainer)

    @property
    def state_key(self) -> str:
        """Return the key of the callback's checkpoint state, unique per configuration.

        It is computed once, and again only when the switch marks the callback as its own,
        because Lightning reads it at every hook.
        """
        return self._state_key

    @property
    def from_environment(self) -> bool:
        """Return whether the ``LIGHTNING_HOOKS`` switch added the callback, not the user."""
        return self._from_environment

    def mark_from_environment(self) -> None:
        """Mark the callback as added by the switch, which gives it a checkpoint key of its own."""
        self._from_environment = True
        fields = state_key_fields(self._state_key_fields, from_environment=True)
        self._state_key = self._generate_state_key(**fields)

    @override
    def setup(self, trainer: TrainerView, pl_module: nn.Module, stage: str) -> None:
        """Start a fit with a new guard; let Lightning skip the per-batch hooks left undefined."""
        if stage != "fit":
            return
        users_own_watches = defers_to_users_own(self, trainer.callbacks)  # type: ignore[attr-defined]
        self.lifecycle.start_fit(trainer, self._new_guard(), watching=not users_own_watches)
        restore_inherited(self, self._shadowed_hooks)  # a fit that ended without a teardown
        self._shadowed_hooks = skip_inherited(self, trainer)  # Lightning calls only those defined

    @override
    @guarded
    def state_dict(self) -> dict[str, Any]:
        """Return the callback's checkpoint state."""
        return self.lifecycle.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hold a checkpoint's state until the next ``on_train_start`` restores it."""
        self.lifecycle.checkpoint.hold(state_dict)

    @override
    @guarded
    def on_train_end(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Log what is pending, check the processes for a failure, flush the loggers, unhook."""
        self.lifecycle.end_training(trainer)

    @override
    @guarded
    def on_exception(
        self, trainer: TrainerView, pl_module: nn.Module, exception: BaseException
    ) -> None:
        """Log what was measured, keep it for a checkpoint, remove the hooks, release the model.

        Lightning's ``OnExceptionCheckpoint`` saves after this hook: it saves what was kept.
        """
        try:
            self.lifecycle.flush(trainer)
            self.lifecycle.keep_failed_fit()
        finally:
            self._release_model()

    @override
    @guarded
    def teardown(self, trainer: TrainerView, pl_module: nn.Module, stage: str) -> None:
        """Remove the hooks and release the model, whatever happened before."""
        self._release_model()

    def _release_model(self) -> None:
        """Remove the fit's module hooks, and drop what Lightning set on the callback for the fit.

        These are the shadows of the inherited per-batch hooks (:func:`~.trainer.skip_inherited`)
        and the model's ``log`` and ``log_dict``, which would keep the model alive.
        """
        self.remove_hooks()
        self.lifecycle.checkpoint.drop_held()  # a checkpoint's state no fit attached to
        restore_inherited(self, self._shadowed_hooks)
        self._shadowed_hooks = ()
        drop_model_logging(self)

    def remove_hooks(self) -> None:
        """Take every hook and statistic of the running fit off the model.

        Calling it again does nothing; the guard calls it after a failure.
        """
        self.lifecycle.remove_hooks()
