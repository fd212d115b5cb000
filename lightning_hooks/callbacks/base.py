"""The base of every callback: when its hooks exist, which steps it measures, when it writes.

:class:`HookCallback` owns the lifecycle (attach, remove on every exit, checkpoints, the guard),
the cadence (sampled steps, logging steps) and the writing (one save of the loggers per hook
round, the dashboard). Subclasses implement :meth:`~HookCallback._attach` and
:meth:`~HookCallback._log_epoch` and extend the hooks under "Extend" below. Checks and the ranks'
agreement live in ``checks.py``; Fabric support in ``fabric.py``.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_hooks.callbacks.checks import (
    agree_ranks,
    check_trainer,
    passed_by_user,
    restore_inherited,
    second_callback,
    skip_inherited,
)
from lightning_hooks.callbacks.fabric import FabricRun, start_run
from lightning_hooks.core.hooks.guard import Guard, guard_hooks
from lightning_hooks.core.transport.distributed import world_size
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.logging import save_loggers, write_dashboards

__all__ = ["HookCallback", "observe_optimizer_step", "read_steps"]


if TYPE_CHECKING:
    _SecondCallback = object
else:
    _SecondCallback = second_callback()

_UNSAVED: weakref.WeakSet[pl.Trainer] = weakref.WeakSet()
"""The trainers whose loggers one of our callbacks wrote to since they were last saved."""


class HookCallback(pl.Callback, _SecondCallback):
    """Base of the library's callbacks: owns when hooks exist, subclasses own what they measure.

    Hooks are attached in ``on_train_start`` and removed, idempotently, in ``on_train_end``,
    ``on_exception`` and ``teardown``. A checkpoint's state (:meth:`_save_state`) waits for the
    hooks, then goes to :meth:`_load_state`; one saved for other layers is dropped, warned.
    """

    every_n_steps: int | None = None
    """Measure steps ``n-1, 2n-1, ...`` and each epoch's first (``None``: ``log_every_n_steps``)."""
    strict: bool | None = None
    """``True``: an exception in one of the callback's hooks propagates; ``False``: it disables
    the callback for the rest of the fit with one warning; ``None``: ``LIGHTNING_HOOKS_STRICT``."""
    uses_images: bool = True
    _tracker: Any = None  # what the hooks feed; ``remove()`` takes them off
    _pending_state: dict[str, Any] | None = None
    _ranks: int = 1
    _from_environment: bool = False  # added by LIGHTNING_HOOKS: yields to the user's own
    _idle: bool = False  # nothing to watch (or the user's own runs): this fit does nothing
    _default_types: Any = None
    _selection_arguments: tuple[str, ...] = ("include", "exclude")
    _epoch_start_step: int = -1
    _sampled_step: int | None = None
    _posted = False  # a logging step's windows were posted, and may not all be written yet
    _batch_step = 0  # the optimizer step the running batch feeds
    _sampled_batch = False  # the running batch belongs to a sampled step
    # Decided at ``_attach``: the quiet batches call no method of a subclass.
    _every_batch = False  # ``_batch_ending`` on every batch, not only the sampled ones
    _own_loss: Any = None  # the alarms fed this rank's loss at each batch end (by ``policy``)
    policy: Any = None
    _on_optimizer_step: Any = None  # more work at each ``on_before_optimizer_step``

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        guard_hooks(cls)

    def _hook_guard(self) -> Guard:
        """This fit's guard of the callback's hooks (see ``core/hooks/guard.py``)."""
        guard: Guard | None = self.__dict__.get("_guard")
        if guard is None:
            guard = self.__dict__["_guard"] = Guard(type(self).__name__, strict=self.strict)
        return guard

    def _guard_disable(self) -> None:
        """After a guarded failure: remove every hook now; the guard keeps the rest off."""
        self._detach()

    @cached_property
    def state_key(self) -> str:
        """Unique per configuration (made once: Lightning reads it for every hook it calls)."""
        return self._generate_state_key(**self._state_key_fields())

    def _state_key_fields(self) -> dict[str, Any]:
        """What makes this instance's checkpoint state distinct (the selection, and whether
        ``LIGHTNING_HOOKS`` added it: Lightning refuses two equal keys)."""
        fields = {
            "types": repr(getattr(self, "types", None)),
            "include": getattr(self, "include", ()),
            "exclude": getattr(self, "exclude", ()),
        }
        return {**fields, "environment": True} if self._from_environment else fields

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or passed_by_user(self, trainer.callbacks):  # type: ignore[attr-defined]
            return
        self.__dict__.pop("_guard", None)  # each fit starts healthy
        check_trainer(self, trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._idle = passed_by_user(self, trainer.callbacks)  # type: ignore[attr-defined]
        if not self._idle:  # after ``configure_model``: the layers built there exist
            self._validate(pl_module)
        skip_inherited(self, trainer)  # for the fit: Lightning calls only the hooks we define

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()
        guard = self._hook_guard()
        self._ranks = world_size()
        # Ranks agree on a failure before any disables (see lightning_hooks.core.hooks.guard).
        guard.defer = not guard.strict and self._ranks > 1
        if self._idle:
            return
        self._attach(trainer, pl_module)
        _load_pending(self)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = self._batch_step = trainer.global_step
        if batch_idx == 0:
            # By batch index, not on_train_epoch_start: a run resumed mid-epoch samples the
            # same steps as the uninterrupted one. Every micro-batch of the step follows.
            self._epoch_start_step = step
        if self._posted:  # on CUDA, the last logging step's copy
            read_steps(self, trainer, wait=False)
        cadence = self.every_n_steps or max(1, int(getattr(trainer, "log_every_n_steps", 50)))
        sampled = (step + 1) % cadence == 0 or step == self._epoch_start_step
        if sampled and self._tracker is not None:
            self._sampled_step = step
        gate = getattr(self._tracker, "registry", None)  # the sampled gate of the module hooks
        if gate is not None and gate.sampled != sampled:  # a quiet step reads it, sets nothing
            gate.sampled = sampled
        if trainer in _UNSAVED:
            _end_round(self, trainer)
        self._sampled_batch = sampled and self._tracker is not None
        if self._sampled_batch:
            self._batch_started(trainer)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if (self._sampled_batch or self._every_batch) and self._batch_ending(trainer, outputs):
            return
        if (alarms := self._own_loss) is not None:  # the loss rules on this rank's loss
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if isinstance(loss, torch.Tensor):
                alarms.update_loss(loss, step=self._batch_step)
                if found := alarms.poll():
                    self.policy.act(trainer, None, found)
        measured = self._sampled_step
        # The sampled step's optimizer step ran (its last micro-batch): a logging step.
        if measured is not None and trainer.global_step > measured:
            self._sampled_step = None
            if _logging_step(self, trainer, measured):
                return
        if trainer in _UNSAVED:
            _end_round(self, trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not agree_ranks(self, trainer, trainer.global_step, always=True):
            _write_epoch(self, trainer, pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._save_state()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_state = dict(state_dict)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._hook_guard().failed is None:  # a failure after the last epoch end: agreed
            agree_ranks(self, trainer, trainer.global_step, always=True)
        self._detach()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:
            self.flush(trainer)
        finally:
            self._release()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    def on_after_setup(self, fabric: Any, module: nn.Module) -> None:
        """Fabric's hook: start watching ``module`` (see :class:`~.fabric.FabricRun`)."""
        start_run(self, fabric, module)

    def flush(self, trainer: pl.Trainer) -> None:
        """Before the hooks go: write what was measured (CUDA: the last logging step's copy)."""
        read_steps(self, trainer, wait=True)
        _save(trainer)

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        """Fabric's hook, when the run could not take the callback's place in its list."""
        run: FabricRun | None = self.__dict__.get("_fabric_run")
        if run is not None:
            run.on_after_optimizer_step(strategy, optimizer)

    def release(self) -> None:
        """Under Fabric: write what is pending and remove every hook now."""
        run: FabricRun | None = self.__dict__.pop("_fabric_run", None)
        if run is not None:
            run.on_train_end()

    def _release(self) -> None:
        """The run is over: remove the hooks and drop the ``log`` / ``log_dict`` Lightning binds
        to every callback (they would keep the model alive after ``fit``)."""
        self._detach()
        restore_inherited(self)
        for bound in ("log", "log_dict"):
            self.__dict__.pop(bound, None)

    # Extend: what a subclass measures and writes.

    def _validate(self, pl_module: pl.LightningModule) -> None:
        """Check the configuration against the model before training starts."""

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    def _detach(self) -> None:
        """Remove the tracker's hooks and drop it (idempotent); override to keep state first."""
        if self._tracker is not None:
            self._tracker.remove()
            self._tracker = None

    def _batch_started(self, trainer: pl.Trainer) -> None:
        """The last of ``on_train_batch_start`` of a sampled step, once its gate is set."""

    def _batch_ending(self, trainer: pl.Trainer, outputs: Any) -> bool:
        """The first of ``on_train_batch_end`` of a sampled step (every batch with
        ``_every_batch``); ``True``: the callback was disabled, stop."""
        return False

    def _log_step(self, trainer: pl.Trainer, step: int) -> None:
        """A logging step: post the window of the steps measured since the last one."""

    def _write_steps(self, trainer: pl.Trainer, wait: bool) -> bool:
        """Write the windows whose copies are done (``wait``: block for them); whether any was."""
        return False

    def _steps_in_flight(self) -> bool:
        """Whether a window :meth:`_log_step` posted is not yet written."""
        return False

    def _log_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    def _save_state(self) -> dict[str, Any]:
        """The statistics so far, reduced across ranks, on the host (every rank calls it)."""
        return {}

    def _load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`_save_state` into freshly attached accumulators; ValueError if foreign."""

    def _agreement_flags(self) -> list[bool]:
        """More flags for the ranks' agreement (:func:`agree_ranks`, each counted over ranks)."""
        return []

    def _agreed(self, trainer: pl.Trainer, step: int, counts: list[int]) -> bool:
        """Act on :meth:`_agreement_flags`' counts; whether the callback is now disabled."""
        return False

    def _carried(self) -> bool:
        """Whether a collective of every batch carries the agreement."""
        return False

    def _wants_stop(self) -> bool:
        """Whether this rank asks every rank to stop (an alarm's ``stop``, not yet agreed)."""
        return False

    def _stop_agreed(self) -> None:
        """The ranks agreed to stop: forget this rank's request."""


guard_hooks(HookCallback)


def observe_optimizer_step(
    callback: Any,
    trainer: pl.Trainer,
    pl_module: pl.LightningModule,
    optimizer: torch.optim.Optimizer,
) -> None:
    """``on_before_optimizer_step`` of a callback holding a gradient tracker: measure the
    gradient ``optimizer`` is about to apply, and act on the alarms read."""
    tracker = callback._tracker
    if tracker is None:
        return
    scaler: Any = getattr(trainer.strategy.precision_plugin, "scaler", None)
    scale = getattr(scaler, "_scale", None) if scaler is not None and scaler.is_enabled() else None
    scale = scale if isinstance(scale, torch.Tensor) else None
    # Lightning does not unscale for optimizers that unscale inside their step (fused).
    fused = scale is not None and getattr(optimizer, "_step_supports_amp_scaling", False)
    tracker.observe(optimizer, scale, scale if fused else None, step=trainer.global_step)
    if callback._on_optimizer_step is not None:
        callback._on_optimizer_step(optimizer)
    if tracker.alarms is not None and (found := tracker.alarms.poll(wait=callback.policy.wait)):
        callback.policy.act(trainer, optimizer, found)


def _load_pending(callback: HookCallback) -> None:
    """Hand a checkpoint's state to the freshly attached accumulators (one warning if foreign)."""
    pending, callback._pending_state = callback._pending_state, None
    if pending:
        try:
            callback._load_state(pending)
        except (KeyError, ValueError) as err:
            rank_zero_warn(
                f"{type(callback).__name__}: the checkpoint's statistics do not match this model "
                f"and are dropped ({err})",
                category=LightningHooksWarning,
            )


# The writing: logging steps, epoch ends, one save of the loggers per hook round.


def _logging_step(callback: HookCallback, trainer: pl.Trainer, measured: int) -> bool:
    """After the sampled step's optimizer step: write the last logging step's copy, post
    this one's; whether the callback is now disabled."""
    if agree_ranks(callback, trainer, measured, always=False):
        return True
    read_steps(callback, trainer, wait=True)
    callback._log_step(trainer, measured)
    callback._posted = True
    read_steps(callback, trainer, wait=False)
    return False


def _write_epoch(
    callback: HookCallback, trainer: pl.Trainer, pl_module: pl.LightningModule
) -> None:
    """At the epoch end: the last logging step, the epoch, the dashboard, one save."""
    read_steps(callback, trainer, wait=True)
    callback._sampled_step = None
    callback._log_epoch(trainer, pl_module)
    if trainer.is_global_zero and _last_of_ours(callback, trainer, live=False):
        write_dashboards(trainer.loggers)  # one layout per run, by the last of ours
    save_loggers(trainer.loggers)
    _UNSAVED.discard(trainer)


def read_steps(callback: HookCallback, trainer: pl.Trainer, wait: bool) -> None:
    """Write what the last logging step measured once its host copy is done (``wait``: block
    for it); without ``wait``, nothing is read unless a posted window is still unwritten."""
    if not (wait or callback._posted):
        return
    if callback._write_steps(trainer, wait):
        _UNSAVED.add(trainer)
    callback._posted = not wait and callback._steps_in_flight()


def _end_round(callback: HookCallback, trainer: pl.Trainer) -> None:
    """Save the loggers once per hook round in which any of ours wrote (so a killed run keeps
    them): the last of ours not failed saves for all."""
    if _last_of_ours(callback, trainer, live=True):
        _save(trainer)


def _last_of_ours(callback: HookCallback, trainer: pl.Trainer, *, live: bool) -> bool:
    """Whether ``callback`` is the last of ours in the Trainer's list (``live``: not failed),
    or none of ours is there."""
    ours = [
        cb
        for cb in trainer.callbacks  # type: ignore[attr-defined]
        if isinstance(cb, HookCallback) and not (live and cb._hook_guard().failed is not None)
    ]
    return not ours or ours[-1] is callback


def _save(trainer: pl.Trainer) -> None:
    """Write the dashboard (rank 0) and save the loggers if any of ours wrote since."""
    if trainer not in _UNSAVED:
        return
    _UNSAVED.discard(trainer)
    if trainer.is_global_zero:
        write_dashboards(trainer.loggers)
    save_loggers(trainer.loggers)
