"""Provide the base class of every callback, which runs its lifecycle, logging and writing.

What one fit measures is an :class:`~.attached.Attached` that the callback builds in
``_attach``. What a Fabric loop calls on a callback is in :class:`~.fabric.FabricHooks`, which
the base derives from.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.attached import Attached, Checkpointed
from lightning_hooks.callbacks.cadence import LoggingCadence, check_every_n_steps
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
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.internals.lightning import drop_model_logging
from lightning_hooks.logging import save_loggers

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
    """Hold the state of one fit of a callback, from its ``setup`` to the next fit's ``setup``.

    Each fit's ``setup`` makes a new one, so a fit starts healthy whatever happened in the
    previous fit.
    """

    guard: Guard
    """The guard of the fit's hooks (see docs/glossary.md). A failure disables the callback for
    the rest of the fit."""
    idle: bool = False
    """Whether the callback does nothing in this fit. This happens when the model has nothing to
    watch, or when a callback the user passed already watches it."""
    checkpoint: dict[str, Any] | None = None
    """The callback's state from a checkpoint, kept from ``load_state_dict`` until the fit
    attaches."""
    attached: Attached | None = None
    """What the fit put on the model, from its train start until its hooks come off."""
    logging_batch: bool = False
    """Whether the running batch belongs to a logging step."""


class HookCallback(FabricHooks, pl.Callback, _SecondCallback, metaclass=ABCMeta):
    """Run a callback's hooks for one fit at a time under a guard, and write what they measure.

    The base drives every fit the same way:

    1. ``on_fit_start`` asks the subclass whether the model has anything to watch
       (``_validate``).
    2. ``on_train_start`` asks the subclass to put its hooks on the model (``_attach``). It
       returns an :class:`~.attached.Attached`: the hooks, the statistics and the functions that
       read each statistic's values.
    3. At a logging step, an optimizer step the callback measures (see docs/glossary.md), the
       base opens the hooks. The subclass may start and end the step (``_batch_started``,
       ``_batch_ending``). The base then copies the statistics to the host and writes them.
    4. At an epoch end the base writes every statistic's epoch, then calls ``_log_epoch``.
    5. The fit ends at the exits below (a fit that ends well: ``on_train_end``, then
       ``teardown``). Each takes every hook off.

    Every Lightning hook runs under the callback's guard
    (:func:`~lightning_hooks.core.hooks.guard.guarded`). An error in the library's own code
    disables the callback for the rest of the fit, with one warning. It never ends the user's
    run.

    ==================  ==============================  ========================================
    extension           called                          the subclass
    ==================  ==============================  ========================================
    ``_validate``       ``on_fit_start``                checks the model; a refused
                                                        configuration raises here. Returns
                                                        ``False`` if there is nothing to watch
    ``_attach``         ``on_train_start``              puts its hooks on; returns what it
                                                        attached
    ``_batch_started``  a logging step's first batch    opens what the step measures
    ``_batch_ending``   each such batch's end (every    closes it
                        batch's with ``every_batch``)
    ``_log_epoch``      ``on_train_epoch_end``, after   logs what else it reads of the epoch
                        each statistic's epoch
    ==================  ==============================  ========================================

    A subclass overrides only these five methods of the base. ``_attach`` is required. The
    others do nothing by default, and an override does not call the base's version. A subclass
    may also define a Lightning hook the base does not define, decorated with ``@guarded`` as
    the base's hooks are. For example, ``GradFlowCallback`` reads each optimizer step in
    ``on_before_optimizer_step``.

    A subclass passes everything else to the constructor: ``state_key``, which tells the
    checkpoints of two configurations apart, ``uses_images`` and ``fabric_refusal``. State that
    outlives a fit and is saved in checkpoints goes in :attr:`kept`. Under several processes,
    :attr:`ranks` (a :class:`~.ranks.RankAgreement`) makes every rank act alike: a failure
    disables the callback on all of them, and a stop stops them all.

    The exits use three verbs. ``flush`` writes what was measured and saves the loggers.
    ``remove_hooks`` takes the fit's hooks and statistics off the model. ``_let_go`` does that
    too, and drops what Lightning set on the callback for the fit, so that nothing of the
    callback keeps the model alive. A second ``remove_hooks`` or ``_let_go`` does nothing.

    ====================  ===============================  ===================================
    exit                  when                             what runs
    ====================  ===============================  ===================================
    ``on_train_end``      the training loop ended          the ranks agree on a last failure,
                                                           the loggers are saved,
                                                           ``remove_hooks``
    ``on_exception``      the fit raised (then Lightning   ``flush``, then ``_let_go``
                          calls no ``teardown``)
    ``teardown``          the end of every stage           ``_let_go``
    the guard, the ranks  a hook of ours failed, on this   ``remove_hooks``; the callback does
                          rank or on another               nothing more in the fit
    ``release``           a Fabric loop's end (also its    ``flush``, ``on_train_end``, then
                          ``on_train_end`` call)           ``teardown``, called by the run
    ====================  ===============================  ===================================

    In a Fabric loop, :class:`~.fabric.FabricHooks`, which the base derives from, answers
    Fabric's calls, and a :class:`~.fabric.FabricRun` drives these same hooks with a stand-in for
    the Trainer. The base itself imports nothing of Fabric (an import-linter contract).

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
            every_n_steps: measure optimizer steps ``n-1, 2n-1, ...`` and each epoch's first
                (``None``: the Trainer's ``log_every_n_steps``).
            strict: if ``True``, a hook's exception is raised. If ``False``, it disables the
                callback for the rest of the fit. If ``None``, the ``LIGHTNING_HOOKS_STRICT``
                environment variable decides.
            uses_images: whether the callback draws pictures. A logger that cannot show them
                is warned of.
            fabric_refusal: why this configuration cannot run in a Fabric loop, or ``None`` if
                it can. It is passed to :class:`~.fabric.FabricHooks`, and a Fabric run refuses
                the callback with this reason at ``fabric.setup``.

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
        """Whether the callback draws pictures. A logger that cannot show them is warned of."""
        self.kept: dict[str, Checkpointed] = {}
        """Collaborators that outlive a fit and are saved in checkpoints, by key."""
        self._fit_state = FitState(self._new_guard())
        """What the running fit holds; each fit's ``setup`` starts a new one."""
        self.ranks = RankAgreement(self.hook_guard, remove_hooks=self.remove_hooks)
        """Makes the ranks of a multi-process fit agree on failures, stops and new rows."""

    @property
    def every_n_steps(self) -> int | None:
        """Return the cadence of the logging steps.

        Optimizer steps ``n-1, 2n-1, ...`` and the first step of each epoch are measured.
        ``None`` stands for the Trainer's ``log_every_n_steps``.
        """
        return self.cadence.every_n_steps

    def hook_guard(self) -> Guard:
        """Return the guard of this fit's hooks.

        Returns:
            The guard: its ``failed`` says whether the callback is disabled, and why.
        """
        return self._fit_state.guard

    def _new_guard(self) -> Guard:
        """Make a guard for a fit that starts healthy.

        Returns:
            A guard with no failure, strict as :attr:`strict` says.
        """
        return Guard(type(self).__name__, strict=self.strict)

    @property
    def state_key(self) -> str:
        """Return the key of the callback's checkpoint state, unique per configuration.

        The same configuration added by the ``LIGHTNING_HOOKS`` switch gets a key of its own
        (:meth:`mark_from_environment`). The key is built when it changes, not when it is
        read, because Lightning reads it for every hook it calls.
        """
        return self._state_key

    @property
    def from_environment(self) -> bool:
        """Return whether the ``LIGHTNING_HOOKS`` switch added the callback, not the user.

        Such a callback stands aside when the user passed a callback of the same class.
        """
        return self._from_environment

    def mark_from_environment(self) -> None:
        """Mark the callback as added by the ``LIGHTNING_HOOKS`` switch.

        Its checkpoint key gets a field of its own, so that its state and that of a callback
        of the same configuration the user passed never share a key.
        """
        self._from_environment = True
        self._state_key = self._generate_state_key(**self._state_key_fields, environment=True)

    @override
    def setup(self, trainer: TrainerView, pl_module: nn.Module, stage: str) -> None:
        if stage != "fit":
            return
        # Each fit starts healthy. A checkpoint loaded before the fit is kept for it.
        self._fit_state = FitState(
            self._new_guard(),
            idle=stands_down_for_users_own(self, trainer.callbacks),  # type: ignore[attr-defined]
            checkpoint=self._fit_state.checkpoint,
        )
        if not self._fit_state.idle:
            check_trainer(
                type(self).__name__,
                trainer,
                uses_images=self.uses_images,
                every_n_steps=self.every_n_steps,
            )

    @override
    def on_fit_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        fit = self._fit_state
        if not fit.idle:  # runs after ``configure_model``, so its layers exist
            fit.idle = not self._validate(pl_module)
        skip_inherited(self, trainer)  # Lightning then calls only the hooks defined here

    @override
    @guarded
    def on_train_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        self.remove_hooks()
        self.ranks.start()
        fit = self._fit_state
        if fit.idle:
            return
        fit.attached = self._attach(trainer, pl_module)
        self._restore_checkpoint(fit)

    def _restore_checkpoint(self, fit: FitState) -> None:
        """Load the checkpoint's state that :meth:`load_state_dict` kept, if any.

        The statistics' state goes to what the fit attached, the rest to :attr:`kept`. A state
        with a part that does not match this model is dropped whole, with one warning.

        Args:
            fit: the running fit, which has just attached.
        """
        pending = fit.checkpoint
        fit.checkpoint = None
        attached = fit.attached
        if not pending or attached is None:
            return
        pending = attached.in_this_layout(pending)
        try:
            afresh = self._load_whole(attached, pending)
        except (KeyError, ValueError) as err:
            parts = ", ".join(["statistics", *(key for key in self.kept if key in pending)])
            rank_zero_warn(
                f"{type(self).__name__}: the checkpoint's state does not match this model "
                f"({err}); none of it is loaded ({parts})",
                category=LightningHooksWarning,
            )
            return
        if afresh:
            rank_zero_warn(
                f"{type(self).__name__}: the checkpoint holds no state of {', '.join(afresh)} "
                "(saved under another configuration); this epoch's values of it start afresh",
                category=LightningHooksWarning,
            )

    def _load_whole(self, attached: Attached, state: dict[str, Any]) -> list[str]:
        """Load a checkpoint's ``state`` into the statistics and into :attr:`kept`, or none of it.

        What :attr:`kept` holds is saved first, so that a part that fails to load, after others
        did, leaves each collaborator as it was before.

        Args:
            attached: what the fit attached, whose statistics load their part of ``state``.
            state: the callback's state, in this release's layout.

        Returns:
            The statistics that start afresh for want of an entry, by class name.

        Raises:
            KeyError: a part of ``state`` lacks what its statistic or collaborator needs. The
                statistics then start afresh, and each collaborator of :attr:`kept` is as it was.
            ValueError: a part of ``state`` does not fit this model; as for ``KeyError``.
        """
        before = {key: kept.host_state() for key, kept in self.kept.items() if key in state}
        try:
            afresh = attached.load_state_dict(
                {k: v for k, v in state.items() if k not in self.kept}
            )
            for key in before:
                self.kept[key].load_host_state(state[key])
        except (KeyError, ValueError):
            attached.reset_statistics()
            for key, earlier in before.items():
                self.kept[key].load_host_state(earlier)
            raise
        return afresh

    @override
    @guarded
    def on_train_batch_start(
        self, trainer: TrainerView, pl_module: nn.Module, batch: Any, batch_idx: int
    ) -> None:
        logging_step = self.cadence.start_batch(trainer, batch_idx)
        attached = self._fit_state.attached
        if attached is not None:
            attached.write_arrived_steps(trainer)  # on CUDA, the last logging step's copy
        self._set_gate(logging_step)
        # Save what the library's callbacks wrote since the last batch's end, so that a run
        # killed in this batch keeps it. Where several of them run, the first to get here saves
        # for all of them, once per batch.
        save_loggers(trainer.loggers, layout=trainer.is_global_zero)
        self._start_measuring(trainer, batch, logging_step=logging_step)

    def _start_measuring(self, trainer: TrainerView, batch: Any, *, logging_step: bool) -> None:  # noqa: ANN401 (the user's batch)
        """Record whether the starting batch is measured, and if so, open what it measures.

        A batch is measured where it belongs to a logging step and the fit attached (a failure
        takes the hooks off, and an idle fit never attaches). The subclass then opens the step
        (``_batch_started``).

        Args:
            trainer: the trainer running the batch.
            batch: the batch as the dataloader gave it, before ``training_step``.
            logging_step: whether the batch belongs to a logging step, as the cadence says.
        """
        fit = self._fit_state
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
        fit = self._fit_state
        if fit.attached is not None and (fit.logging_batch or fit.attached.every_batch):
            self._batch_ending(trainer, outputs, logging_step=fit.logging_batch)
        measured = self.cadence.finished_step(trainer)
        attached = fit.attached  # a failure in the batch's hooks may have taken it off
        if measured is not None and attached is not None:
            self._end_logging_step(trainer, measured, attached)

    def _end_logging_step(self, trainer: TrainerView, step: int, attached: Attached) -> None:
        """Write a logging step whose optimizer step has run (its last micro-batch ended).

        The ranks agree first. If they agree on a failure, the callback is disabled on every
        rank and nothing is written. Otherwise the step's values are written. The module hooks
        then close unless the next step is a logging step too. A step that is not a logging
        step therefore runs none of the library's hooks.

        Args:
            trainer: the trainer whose loggers are written to.
            step: the logging step.
            attached: what the fit attached, whose statistics are written.
        """
        self.ranks.agree(trainer, step, attached, always=False)
        if self.hook_guard().failed is not None:
            return
        attached.end_logging_step(trainer, step)
        self._set_gate(self.cadence.logs(trainer, trainer.global_step))

    def _set_gate(self, logging_step: bool) -> None:
        """Open or close the gate of the module hooks.

        The gate is the switch that puts the module hooks on the model for a logging step and
        takes them off after it (see docs/glossary.md). It is set only when its value changes,
        so a step that is not a logging step only reads it.

        Args:
            logging_step: whether the coming batch belongs to a logging step. If so, the gate
                opens.
        """
        attached = self._fit_state.attached
        gate = None if attached is None else attached.registry
        if gate is not None and gate.logging_step != logging_step:
            gate.set_logging_step(logging_step)

    @override
    @guarded
    def on_train_epoch_end(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        self.ranks.agree(trainer, trainer.global_step, self._fit_state.attached, always=True)
        self.cadence.end_epoch()
        attached = self._fit_state.attached  # a failure the ranks agreed on takes it off
        if attached is not None:
            attached.write_steps(trainer, wait=True)
            attached.write_epoch(trainer)  # each statistic's epoch, then the next one starts
            self._log_epoch(trainer, pl_module)
        save_loggers(trainer.loggers)  # the chart layout waits for the next batch's save

    @override
    @guarded
    def state_dict(self) -> dict[str, Any]:
        """Return what a checkpoint saves of the callback.

        Returns:
            The epoch so far of each statistic, reduced across ranks, on the host, and the
            state of what :attr:`kept` holds, by key.
        """
        attached = self._fit_state.attached
        state: dict[str, Any] = {}
        if attached is not None:
            if self.ranks.size > 1 and attached.aligned:
                attached.align_rows()  # include the rows made since the last logging step
            state = attached.state_dict()
        for key, kept in self.kept.items():
            state[key] = kept.host_state()
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpoint's state until the next fit attaches its statistics.

        Args:
            state_dict: the callback's state as the checkpoint holds it; loaded into the statistics
                and into :attr:`kept` at the next ``on_train_start``.
        """
        self._fit_state.checkpoint = dict(state_dict)

    @override
    @guarded
    def on_train_end(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        try:
            if self.hook_guard().failed is None:  # agree on a failure after the last epoch end
                attached = self._fit_state.attached
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
        """Write what was measured before the hooks go.

        On CUDA this waits for the last logging step's copy and writes it. The loggers are then
        saved. ``on_exception`` calls this method. So does the end of a Fabric loop, which may
        come without an epoch end before it (see the exits in the class's docstring).

        Args:
            trainer: the trainer whose loggers are written to and saved.
        """
        attached = self._fit_state.attached
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
        """Take every hook of the running fit off the model.

        What the fit attached is removed, and the fit's statistics with it. Calling it again does
        nothing; the guard calls it after a failure.
        """
        attached = self._fit_state.attached
        self._fit_state.attached = None
        if attached is not None:
            attached.remove()

    def _validate(self, pl_module: nn.Module) -> bool:
        """Check the model at ``on_fit_start``, and say whether the fit has anything to watch.

        A configuration the callback cannot watch raises here, before training starts. The default
        accepts every model.

        Args:
            pl_module: the model the fit trains, after ``configure_model`` (the layers built there
                exist).

        Returns:
            Whether the fit has anything to watch (``False``: the callback does nothing in it).
        """
        return True

    @abstractmethod
    def _attach(self, trainer: TrainerView, pl_module: nn.Module) -> Attached:
        """Put the fit's hooks on ``pl_module`` at each fit's train start.

        Args:
            trainer: the trainer of the fit, whose optimizers, strategy or loggers the callback may
                read to decide what to attach.
            pl_module: the model the hooks are put on.

        Returns:
            What the fit attached: its hooks' registry, its statistics and what the callback
            reads of them.
        """

    def _batch_started(self, trainer: TrainerView, batch: Any) -> None:  # noqa: ANN401 (the user's batch)
        """Open what a logging step measures, at the step's first batch, with its hooks on.

        The default does nothing.

        Args:
            trainer: the trainer running the batch (its ``global_step`` is the logging step).
            batch: the batch as the dataloader gave it, before ``training_step``.
        """

    def _batch_ending(
        self, trainer: TrainerView, outputs: STEP_OUTPUT, *, logging_step: bool
    ) -> None:
        """Close what a logging step's batch measured, at its end, while the hooks are on.

        Where the fit attached with ``every_batch``, it runs at the end of every batch. The default
        does nothing.

        Args:
            trainer: the trainer running the batch, whose step and loggers a subclass may
                read.
            outputs: what the batch's ``training_step`` returned (where its loss is read).
            logging_step: whether the batch belongs to a logging step (``False`` only where the fit
                attached with ``every_batch``).
        """

    def _log_epoch(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Log what else the callback reads of the epoch, after each statistic's epoch is written.

        The default logs nothing.

        Args:
            trainer: the trainer whose loggers are written to, at the epoch's step
                (:func:`~.attached.epoch_step`).
            pl_module: the model trained, for a callback that reads it at the epoch's end.
        """
