"""The base class of every callback, which runs the lifecycle of its fits.

The methods a Fabric loop calls on a callback are in :class:`~.fabric.FabricHooks`, from which
the base derives.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.attached import Attached, Checkpointed
from lightning_hooks.callbacks.cadence import LoggingCadence, check_every_n_steps
from lightning_hooks.callbacks.checkpoint import CheckpointSlot
from lightning_hooks.callbacks.fabric import FabricHooks
from lightning_hooks.callbacks.ranks import RankAgreement
from lightning_hooks.callbacks.trainer import (
    SECOND_CALLBACK,
    TrainerView,
    check_trainer,
    restore_inherited,
    skip_inherited,
    stands_down_for_users_own,
)
from lightning_hooks.core.hooks.guard import Guard, guarded
from lightning_hooks.internals.lightning import drop_model_logging
from lightning_hooks.logging import save_loggers
from lightning_hooks.switch import state_key_fields

__all__ = ["FitState", "HookCallback"]

# Lightning ships under two names, ``pytorch_lightning`` and ``lightning.pytorch``. Each
# namespace's LightningCLI accepts only its own ``Callback``, so the base derives from both
# where both are installed. To the type checker, ``lightning.pytorch.Callback`` is ``object``.
if TYPE_CHECKING:
    _SecondCallback = object
else:
    _SecondCallback = SECOND_CALLBACK


@dataclass
class FitState:
    """The state of one fit of a callback, from its ``setup`` to the next fit's ``setup``.

    Each fit's ``setup`` makes a new one, so a fit starts healthy whatever happened before.
    """

    guard: Guard
    idle: bool = False
    """Whether the callback does nothing in this fit: the model has nothing to watch, or a
    callback the user passed already watches it."""
    attached: Attached | None = None
    """What the fit put on the model, from its train start until its hooks come off."""
    logging_batch: bool = False


class HookCallback(FabricHooks, pl.Callback, _SecondCallback, metaclass=ABCMeta):
    """Runs a callback's hooks for one fit at a time, under a guard, and writes what they measure.

    A subclass writes ``_attach``, and may write any of the four other extension points. It
    overrides no other method of the base, and an override does not call the base's version:

    - ``_validate`` (at ``on_fit_start``): checks the model; returns ``False`` if there is
      nothing to watch.
    - ``_attach`` (at ``on_train_start``): puts the fit's hooks on the model and returns the
      :class:`~.attached.Attached`.
    - ``_batch_started`` (a logging step's first batch): opens what the step measures.
    - ``_batch_ending`` (the end of each such batch, or of every batch with ``every_batch``):
      closes it.
    - ``_epoch_ending`` (at ``on_train_epoch_end``, after each statistic's epoch): closes the
      epoch for the callback, and logs what else it reads of it.

    A subclass may also define a Lightning hook the base does not, decorated with ``@guarded``
    as the base's hooks are (``GradFlowCallback`` reads ``on_before_optimizer_step``).

    Every Lightning hook here runs under the fit's guard: an error in the library's own code
    disables the callback for the rest of the fit, with one warning, and never ends the run.
    Every exit of a fit (``on_train_end``, ``on_exception``, ``teardown``, a failure) takes
    the hooks off; docs/architecture.md lists what each does. The base also holds what the
    callbacks share: :attr:`cadence`, :attr:`ranks` and :attr:`checkpoint`.

    Example:
        >>> import pytorch_lightning as pl
        >>> from lightning_hooks.callbacks.attached import Logged
        >>> from lightning_hooks.callbacks.stats import attach_stats
        >>> from lightning_hooks.core.stats.activation_stats import ActivationStatsTracker
        >>> class Activations(HookCallback):
        ...     def __init__(self):
        ...         self.tracker = ActivationStatsTracker(owner="Activations")
        ...         super().__init__(state_key={"stats": [self.tracker.config_key()]})
        ...     def _attach(self, trainer, pl_module):
        ...         return attach_stats(pl_module, self.hook_guard(), [Logged(self.tracker)])
        >>> Activations().every_n_steps is None  # the Trainer's log_every_n_steps
        True
        >>> trainer = pl.Trainer(callbacks=[Activations()])  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        state_key: Mapping[str, Any],
        every_n_steps: int | None = None,
        strict: bool | None = None,
        uses_images: bool = False,
        fabric_refusal: str | None = None,
    ) -> None:
        """Set the cadence and the guard's strictness, and the state every fit starts from.

        Args:
            state_key: the fields that tell this configuration's checkpoint state apart from
                another's (Lightning refuses two callbacks with one key).
            every_n_steps: the cadence of the logging steps (see :class:`~.cadence.LoggingCadence`).
            strict: if ``True``, a hook's exception is raised. If ``False``, it disables the
                callback for the rest of the fit. If ``None``, the ``LIGHTNING_HOOKS_STRICT``
                environment variable decides.
            uses_images: whether the callback draws pictures. A logger that cannot show them
                is warned of.
            fabric_refusal: why this configuration cannot run in a Fabric loop, or ``None``.
                A Fabric run refuses the callback with this reason at ``fabric.setup``.

        Raises:
            ValueError: ``every_n_steps`` is not a positive int or ``None``.
        """
        super().__init__(fabric_refusal=fabric_refusal)
        self._state_key_fields = dict(state_key)
        self.cadence = LoggingCadence(check_every_n_steps(type(self).__name__, every_n_steps))
        """Which optimizer steps are logging steps, and where the running one is."""
        self.strict = strict
        self._from_environment = False
        self._state_key = self._generate_state_key(**self._state_key_fields)
        self.uses_images = uses_images
        self.checkpoint = CheckpointSlot(type(self).__name__)
        """Saves the callback's state in checkpoints, and restores it when a fit attaches."""
        self._lifecycle = FitState(self._new_guard())
        self.ranks = RankAgreement(self.hook_guard, remove_hooks=self.remove_hooks)
        """Makes the ranks of a multi-process fit agree on failures, stops and new rows."""

    @property
    def every_n_steps(self) -> int | None:
        """Return the cadence of the logging steps; ``None`` means ``log_every_n_steps``."""
        return self.cadence.every_n_steps

    def hook_guard(self) -> Guard:
        """Return the guard of this fit's hooks.

        Its ``failed`` says whether the callback is disabled, and why.
        """
        return self._lifecycle.guard

    def _new_guard(self) -> Guard:
        """Make a guard with no failure, strict as :attr:`strict` says."""
        return Guard(type(self).__name__, strict=self.strict)

    @property
    def kept(self) -> dict[str, Checkpointed]:
        """Return the collaborators that outlive a fit and are saved in checkpoints, by key."""
        return self.checkpoint.kept

    @property
    def state_key(self) -> str:
        """Return the key of the callback's checkpoint state, unique per configuration.

        It is built when it changes, not when read, because Lightning reads it at every hook.
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
        if stage != "fit":
            return
        self._lifecycle = FitState(  # each fit starts healthy
            self._new_guard(),
            idle=stands_down_for_users_own(self, trainer.callbacks),  # type: ignore[attr-defined]
        )
        if not self._lifecycle.idle:
            check_trainer(
                type(self).__name__,
                trainer,
                uses_images=self.uses_images,
                every_n_steps=self.every_n_steps,
            )

    @override
    def on_fit_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        fit = self._lifecycle
        if not fit.idle:  # runs after ``configure_model``, so its layers exist
            fit.idle = not self._validate(pl_module)
        skip_inherited(self, trainer)  # Lightning then calls only the hooks defined here

    @override
    @guarded
    def on_train_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        self.remove_hooks()
        self.ranks.start()
        fit = self._lifecycle
        if fit.idle:
            return
        fit.attached = self._attach(trainer, pl_module)
        self.checkpoint.restore(fit.attached)  # a checkpoint loaded before the fit, if any

    @override
    @guarded
    def on_train_batch_start(
        self, trainer: TrainerView, pl_module: nn.Module, batch: Any, batch_idx: int
    ) -> None:
        logging_step = self.cadence.start_batch(trainer, batch_idx)
        attached = self._lifecycle.attached
        if attached is not None:
            attached.write_arrived_steps(trainer)  # on CUDA, the last logging step's copy
        self._set_gate(logging_step)
        # Save what was written since the last batch's end, so that a run killed in this batch
        # keeps it. The first of the library's callbacks to get here saves for all, once.
        save_loggers(trainer.loggers, layout=trainer.is_global_zero)
        self._start_measuring(trainer, batch, logging_step=logging_step)

    def _start_measuring(self, trainer: TrainerView, batch: Any, *, logging_step: bool) -> None:  # noqa: ANN401 (the user's batch)
        """Measure the batch if it belongs to a logging step and the fit attached.

        A failure takes the hooks off, and an idle fit never attaches.
        """
        fit = self._lifecycle
        fit.logging_batch = logging_step and fit.attached is not None
        if fit.logging_batch:
            self.cadence.measure()
            self._batch_started(trainer, batch)

    @override
    @guarded
    def on_train_batch_end(
        self,
        trainer: TrainerView,
        pl_module: nn.Module,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        fit = self._lifecycle
        if fit.attached is not None and (fit.logging_batch or fit.attached.every_batch):
            self._batch_ending(trainer, outputs, logging_step=fit.logging_batch)
        measured = self.cadence.finished_step(trainer)
        attached = fit.attached  # a failure in the batch's hooks may have taken it off
        if measured is not None and attached is not None:
            self._end_logging_step(trainer, measured, attached)

    def _end_logging_step(self, trainer: TrainerView, step: int, attached: Attached) -> None:
        """Write a logging step whose optimizer step has run (its last micro-batch ended).

        The ranks agree first; on a failure the callback is disabled on every rank and nothing
        is written. The module hooks then close unless the next step is a logging step too, so
        a step that is not a logging step runs none of the library's hooks.
        """
        self.ranks.agree(trainer, step, attached, always=False)
        if self.hook_guard().failed is not None:
            return
        attached.end_logging_step(trainer, step)
        self._set_gate(self.cadence.logs(trainer, trainer.global_step))

    def _set_gate(self, logging_step: bool) -> None:
        """Open the gate for a logging step, else close it (see docs/glossary.md).

        It is set only when its value changes, so a step that is not a logging step only reads it.
        """
        attached = self._lifecycle.attached
        gate = None if attached is None else attached.registry
        if gate is not None and gate.logging_step != logging_step:
            gate.set_logging_step(logging_step)

    @override
    @guarded
    def on_train_epoch_end(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        self.ranks.agree(trainer, trainer.global_step, self._lifecycle.attached, always=True)
        self.cadence.end_epoch()
        attached = self._lifecycle.attached  # a failure the ranks agreed on takes it off
        if attached is not None:
            attached.write_steps(trainer, wait=True)
            attached.write_epoch(trainer)  # each statistic's epoch, then the next one starts
            self._epoch_ending(trainer, pl_module)
        save_loggers(trainer.loggers)  # the chart layout waits for the next batch's save

    @override
    @guarded
    def state_dict(self) -> dict[str, Any]:
        """Return what a checkpoint saves of the callback."""
        attached = self._lifecycle.attached
        if attached is not None and self.ranks.size > 1 and attached.aligned:
            attached.align_rows()  # include the rows made since the last logging step
        return self.checkpoint.save(attached)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Store a checkpoint's state until the next ``on_train_start`` loads it."""
        self.checkpoint.hold(state_dict)

    @override
    @guarded
    def on_train_end(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        try:
            if self.hook_guard().failed is None:  # agree on a failure after the last epoch end
                attached = self._lifecycle.attached
                self.ranks.agree(trainer, trainer.global_step, attached, always=True)
            save_loggers(trainer.loggers, layout=trainer.is_global_zero)
        finally:
            self.remove_hooks()

    @override
    @guarded
    def on_exception(
        self, trainer: TrainerView, pl_module: nn.Module, exception: BaseException
    ) -> None:
        try:
            self.flush(trainer)
        finally:
            self._let_go()

    @override
    @guarded
    def teardown(self, trainer: TrainerView, pl_module: nn.Module, stage: str) -> None:
        self._let_go()

    def flush(self, trainer: TrainerView) -> None:
        """Write what was measured before the hooks go, then save the loggers.

        On CUDA this waits for the last logging step's copy. ``on_exception`` calls it, and so
        does the end of a Fabric loop, which may come without an epoch end before it.
        """
        attached = self._lifecycle.attached
        if attached is not None:
            attached.write_steps(trainer, wait=True)
        save_loggers(trainer.loggers, layout=trainer.is_global_zero)

    def _let_go(self) -> None:
        """Take the fit's hooks off, and drop what Lightning set on the callback for the fit.

        These are the shadows of the inherited per-batch hooks (:func:`~.trainer.skip_inherited`)
        and the model's ``log`` and ``log_dict``, which would keep the model alive.
        """
        self.remove_hooks()
        restore_inherited(self)
        drop_model_logging(self)

    def remove_hooks(self) -> None:
        """Take every hook and statistic of the running fit off the model.

        Calling it again does nothing; the guard calls it after a failure.
        """
        attached = self._lifecycle.attached
        self._lifecycle.attached = None
        if attached is not None:
            attached.remove()

    def _validate(self, pl_module: nn.Module) -> bool:
        """Check the model at ``on_fit_start``, after ``configure_model``.

        A configuration the callback cannot watch raises here, before training starts. The default
        accepts every model.

        Returns:
            Whether the fit has anything to watch (``False``: the callback does nothing in it).
        """
        return True

    @abstractmethod
    def _attach(self, trainer: TrainerView, pl_module: nn.Module) -> Attached:
        """Put the fit's hooks on ``pl_module`` at each fit's train start.

        Returns:
            What the fit attached: its hooks' registry, its statistics and what the callback
            reads of them.
        """

    def _batch_started(self, trainer: TrainerView, batch: Any) -> None:  # noqa: ANN401 (the user's batch)
        """Open what a logging step measures, at its first batch, before ``training_step``.

        The hooks are on, and ``trainer.global_step`` is the logging step. The default does
        nothing.
        """

    def _batch_ending(
        self, trainer: TrainerView, outputs: STEP_OUTPUT, *, logging_step: bool
    ) -> None:
        """Close what a logging step's batch measured, at its end, while the hooks are on.

        Where the fit attached with ``every_batch``, it runs at the end of every batch, and
        ``logging_step`` says whether the batch belongs to a logging step. The default does
        nothing.
        """

    def _epoch_ending(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Close the epoch for the callback, after each statistic's epoch is written.

        What it logs goes at the epoch's step (:func:`~.attached.epoch_step`). The default does
        nothing.
        """
