"""The base of every callback: its lifecycle, its logging steps and its writing. A quiet step
runs only this module's hooks: a subclass's part is set at ``_attach``."""

from __future__ import annotations

import weakref
from abc import ABCMeta, abstractmethod
from collections.abc import Callable, Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

import pytorch_lightning as pl
import torch
from lightning_fabric import Fabric
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from typing_extensions import override

from lightning_hooks import internals
from lightning_hooks.callbacks.alarm_policy import AlarmPolicy
from lightning_hooks.callbacks.fabric import FabricRun
from lightning_hooks.callbacks.trainer import (
    SECOND_CALLBACK,
    check_trainer,
    passed_by_user,
    restore_inherited,
    skip_inherited,
)
from lightning_hooks.core.alarms import GradientAlarms
from lightning_hooks.core.checks import positive_int
from lightning_hooks.core.hooks.guard import Guard, guard_hooks
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.stats.grad_flow import GradFlowTracker
from lightning_hooks.core.transport import agree, gather_objects, world_size
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.internals.lightning import fabric_callbacks
from lightning_hooks.logging import save_loggers, write_dashboards

__all__ = [
    "Engine",
    "HookCallback",
    "check_every_n_steps",
    "training_loss",
]

if TYPE_CHECKING:
    _SecondCallback = object
else:
    _SecondCallback = SECOND_CALLBACK

_UNSAVED: weakref.WeakSet[pl.Trainer] = weakref.WeakSet()
"""The trainers whose loggers one of our callbacks wrote to since they were last saved: it spans
callbacks, since the last of ours in the Trainer's list saves for all (one save per batch)."""


class Engine(Protocol):
    """What a callback's hooks feed, as the base sees it: the registry whose logging-step gate it
    sets at each batch start (``None``: no module hook to gate), and ``remove()``, which takes
    every hook off the model."""

    @property
    def registry(self) -> HookRegistry | None: ...

    def remove(self) -> None: ...


class HookCallback(pl.Callback, _SecondCallback, metaclass=ABCMeta):
    """Base of the library's callbacks: owns when hooks exist (from ``on_train_start`` to
    ``on_train_end``, ``on_exception`` or ``teardown``), subclasses own what they measure."""

    every_n_steps: int | None = None  # measure steps n-1, 2n-1, ... (None: log_every_n_steps)
    from_environment: bool = False
    """Added by the ``LIGHTNING_HOOKS`` switch, not by the user: yields to one the user passed."""
    strict: bool | None = None  # a hook's exception: raise, or disable (None: the environment)
    uses_images: bool = True
    policy: AlarmPolicy | None = None  # what acts on the alarms (GradFlowCallback's)
    _tracker: Engine | None = None  # what the hooks feed; ``remove()`` takes them off
    _optimizer_steps: GradFlowTracker | None = None  # measured at each optimizer step
    _pending_state: dict[str, Any] | None = None
    _ranks: int = 1
    _idle: bool = False  # nothing to watch (or the user's own runs): this fit does nothing
    _default_types: Any = None
    _selection_arguments: tuple[str, ...] = ("include", "exclude")
    _epoch_start_step: int = -1
    _logged_step: int | None = None
    _posted = False  # a logging step's windows were posted, and may not all be written yet
    _batch_step = 0  # the optimizer step the running batch feeds
    _logging_batch = False  # the running batch belongs to a logging step
    # Set by ``_attach``, so that a quiet batch calls no method of a subclass:
    _every_batch = False  # ``_batch_ending`` on every batch, not only the logging steps' ones
    _own_loss: GradientAlarms | None = None  # the alarms fed this rank's loss at each batch end
    _on_optimizer_step: Callable[[torch.optim.Optimizer], None] | None = None  # more work then

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        guard_hooks(cls)

    def _hook_guard(self) -> Guard:
        guard: Guard | None = self.__dict__.get("_guard")
        if guard is None:
            guard = Guard(type(self).__name__, strict=self.strict)
            self.__dict__["_guard"] = guard
        return guard

    def _guard_disable(self) -> None:  # after a guarded failure; the guard keeps the rest off
        self._detach()

    @cached_property
    def state_key(self) -> str:
        """Unique per configuration (made once: Lightning reads it for every hook it calls)."""
        return self._generate_state_key(**self._state_key_fields())

    def _state_key_fields(self) -> dict[str, Any]:
        """What makes the checkpoint state distinct (Lightning refuses two equal keys)."""
        selection = {name: getattr(self, name, ()) for name in ("include", "exclude")}
        fields = {"types": repr(getattr(self, "types", None)), **selection}
        return {**fields, "environment": True} if self.from_environment else fields

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or passed_by_user(self, trainer.callbacks):  # type: ignore[attr-defined]
            return
        self.__dict__.pop("_guard", None)  # each fit starts healthy
        check_trainer(type(self).__name__, trainer, uses_images=self.uses_images)

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
        pending = self._pending_state
        self._pending_state = None
        if pending:  # a checkpoint's state, to the freshly attached accumulators
            try:
                self._load_state(pending)
            except (KeyError, ValueError) as err:
                rank_zero_warn(
                    f"{type(self).__name__}: the checkpoint's statistics do not match this "
                    f"model and are dropped ({err})",
                    category=LightningHooksWarning,
                )

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_step = trainer.global_step
        step = self._batch_step
        if batch_idx == 0:
            # By batch index, not on_train_epoch_start: a run resumed mid-epoch samples the
            # same steps as the uninterrupted one. Every micro-batch of the step follows.
            self._epoch_start_step = step
        if self._posted:  # on CUDA, the last logging step's copy
            self._read_steps(trainer, wait=False)
        logs = self._cadence_logs(trainer, step) or step == self._epoch_start_step
        self._set_gate(logs)
        if trainer in _UNSAVED and self._last_of_ours(trainer, live=True):
            _save(trainer)  # once per hook round in which any of ours wrote: a killed run keeps it
        self._logging_batch = logs and self._tracker is not None
        if self._logging_batch:
            self._logged_step = step
            self._batch_started(trainer)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: STEP_OUTPUT,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if (self._logging_batch or self._every_batch) and self._batch_ending(trainer, outputs):
            return
        alarms = self._own_loss
        if alarms is not None:  # the loss rules on this rank's loss
            loss = training_loss(trainer, outputs)
            if loss is not None:
                alarms.update_loss(loss, step=self._batch_step)
                found = alarms.poll()
                if found and self.policy is not None:
                    self.policy.act(trainer, None, found)
        measured = self._logged_step
        # The logging step's optimizer step ran (its last micro-batch): write it.
        if measured is not None and trainer.global_step > measured:
            self._logged_step = None
            if self._agree_ranks(trainer, measured, always=False):
                return  # disabled
            self._read_steps(trainer, wait=True)  # the last logging step's, then post this one
            self._log_step(trainer, measured)
            self._posted = True
            self._read_steps(trainer, wait=False)
            # the module hooks come off now, unless the next step logs too: a quiet step after
            # a logging step takes no hook off (an epoch's first step puts them on again)
            self._set_gate(self._cadence_logs(trainer, trainer.global_step))
        if trainer in _UNSAVED and self._last_of_ours(trainer, live=True):
            _save(trainer)  # once per hook round in which any of ours wrote: a killed run keeps it

    def _cadence_logs(self, trainer: pl.Trainer, step: int) -> bool:
        """Whether optimizer step ``step`` is a logging step by the cadence (steps n-1, 2n-1, ...
        of ``every_n_steps``, else of the Trainer's ``log_every_n_steps``)."""
        cadence = self.every_n_steps or max(1, int(getattr(trainer, "log_every_n_steps", 50)))
        return (step + 1) % cadence == 0

    def _set_gate(self, logging_step: bool) -> None:
        """Open or close the gate of the module hooks (a quiet step reads it, sets nothing)."""
        gate = None if self._tracker is None else self._tracker.registry
        if gate is not None and gate.logging_step != logging_step:
            gate.set_logging_step(logging_step)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._agree_ranks(trainer, trainer.global_step, always=True):
            self._read_steps(trainer, wait=True)
            self._logged_step = None
            self._log_epoch(trainer, pl_module)
            if trainer.is_global_zero and self._last_of_ours(trainer, live=False):
                write_dashboards(trainer.loggers)  # one layout per run, by the last of ours
            save_loggers(trainer.loggers)
            _UNSAVED.discard(trainer)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_state = dict(state_dict)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        try:
            if self._hook_guard().failed is None:  # a failure after the last epoch end: agreed
                self._agree_ranks(trainer, trainer.global_step, always=True)
        finally:
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

    def on_after_setup(self, fabric: Fabric, module: nn.Module) -> None:
        """Fabric's hook: watch ``module`` with a :class:`~.fabric.FabricRun` in our place."""
        callbacks = fabric_callbacks(fabric)
        ours = [c.callback if isinstance(c, FabricRun) else c for c in callbacks or ()]
        if passed_by_user(self, ours):
            return  # LIGHTNING_HOOKS asked for a callback the user passed already
        run = FabricRun(self, fabric, module)
        self.__dict__["_fabric_run"] = run
        if callbacks is not None and self in callbacks:
            # fabric.call(...) passes Fabric's arguments: the run answers, not the Trainer hooks.
            callbacks[callbacks.index(self)] = run
        run.start()

    def flush(self, trainer: pl.Trainer) -> None:
        """Before the hooks go: write what was measured (CUDA: the last logging step's copy)."""
        self._read_steps(trainer, wait=True)
        _save(trainer)

    def on_after_optimizer_step(self, strategy: object, optimizer: torch.optim.Optimizer) -> None:
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
        """Remove the hooks; drop Lightning's bound ``log`` / ``log_dict`` (they keep the model)."""
        self._detach()
        restore_inherited(self)
        for bound in ("log", "log_dict"):
            self.__dict__.pop(bound, None)

    def _read_steps(self, trainer: pl.Trainer, wait: bool) -> None:
        """Write the last logging step once its host copy is done (``wait``: block for it)."""
        if not (wait or self._posted):
            return
        if self._write_steps(trainer, wait):
            _UNSAVED.add(trainer)
        self._posted = not wait and self._steps_in_flight()

    def _last_of_ours(self, trainer: pl.Trainer, *, live: bool) -> bool:
        """Whether this is the last of our callbacks (``live``: not failed) in the Trainer's list:
        the one that saves the loggers and writes the dashboard for all of ours."""
        ours = [
            cb
            for cb in trainer.callbacks  # type: ignore[attr-defined]
            if isinstance(cb, HookCallback) and not (live and cb._hook_guard().failed is not None)  # noqa: SLF001 (another instance of this class)
        ]
        return not ours or ours[-1] is self

    def _agree_ranks(self, trainer: pl.Trainer, step: int, *, always: bool) -> bool:
        """At a logging step (``always``: an epoch end) of a multi-process run, agree on a failure
        and a ``stop``, unless every batch's loss collective carries them already (see
        :mod:`.agreement`); whether the callback is now disabled."""
        guard = self._hook_guard()
        if self._ranks == 1 or guard.failed is not None or (self._votes_carried() and not always):
            return guard.failed is not None
        stop = self.policy is not None and self.policy.stop_requested
        failed, stopping, *extra = agree([guard.local is not None, stop, *self._agreement_flags()])
        disabled = self._settle(trainer, step, failed, stopping)
        return disabled or bool(self._agreed(trainer, step, extra))

    def _settle(self, trainer: pl.Trainer, step: int, failed: int, stopping: int) -> bool:
        """Stop if any rank asked; if any failed, disable the callback on every rank (one
        warning); whether disabled."""
        if stopping:
            trainer.should_stop = True
            if self.policy is not None:
                self.policy.stop_requested = False
        local = self._hook_guard().local
        return bool(failed) and self._disable(trainer, step, gather_objects(local))

    def _disable(self, trainer: pl.Trainer, step: int, causes: list[Any]) -> bool:
        """Disable the callback on every rank, one warning on rank 0 naming each rank's cause."""
        guard = self._hook_guard()
        guard.settle(causes, step, warn=trainer.is_global_zero)
        guard.take_pending()
        self._guard_disable()
        return True

    def _nothing_to_watch(self, what: str, hint: str = "") -> None:
        """Nothing to watch: a ``ValueError`` if the user selected, else one warning and an idle
        fit (as Lightning's ``LearningRateMonitor`` without a scheduler)."""
        name = type(self).__name__
        types = getattr(self, "types", None)
        given = [f"types={types!r}"] if types is not None and types != self._default_types else []
        for argument in self._selection_arguments:
            value = getattr(self, argument, None)
            if value:
                given.append(f"{argument}={value!r}")
        if given:
            raise ValueError(f"{name}({', '.join(given)}): selects no {what} of the model{hint}")
        rank_zero_warn(
            f"{name}: the model has no {what} to watch at the defaults; this callback does "
            f"nothing in this fit{hint}",
            category=LightningHooksWarning,
        )
        self._idle = True

    def _observe_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """``on_before_optimizer_step`` of a callback that measures every optimizer step (set by
        that callback; defined here, so that a quiet step runs this module only): measure the
        gradient ``optimizer`` is about to apply, and act on the alarms read."""
        tracker = self._optimizer_steps
        if tracker is None:
            return
        scaler: Any = getattr(trainer.strategy.precision_plugin, "scaler", None)
        enabled = scaler is not None and scaler.is_enabled()
        scale = internals.grad_scaler_scale(scaler) if enabled else None  # no sync
        # Lightning does not unscale for optimizers that unscale inside their step (fused).
        fused = scale is not None and internals.steps_unscale_themselves(optimizer)
        tracker.observe(optimizer, scale, scale if fused else None, step=trainer.global_step)
        if self._on_optimizer_step is not None:
            self._on_optimizer_step(optimizer)
        alarms = tracker.alarms
        policy = self.policy
        if alarms is None or policy is None:
            return
        found = alarms.poll(wait=policy.wait)
        if found:
            policy.act(trainer, optimizer, found)

    # Extend: ``_attach``, ``_log_epoch``; ``_validate`` the model; a logging step's batch
    # (``_batch_started``, ``_batch_ending``: True if disabled) and window (``_log_step`` posts,
    # ``_write_steps`` writes, ``_steps_in_flight``); ``state_dict`` / ``_load_state`` (ValueError
    # if foreign); flags the ranks agree on (``_agreement_flags``; ``_agreed``: True if disabled).

    @abstractmethod
    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At each fit's train start: put the hooks on ``pl_module`` and set :attr:`_tracker`."""

    @abstractmethod
    def _log_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At each epoch end: write the epoch's aggregates and pictures, then reset them."""

    def _validate(self, pl_module: pl.LightningModule) -> None: ...

    def _detach(self) -> None:
        if self._tracker is not None:
            self._tracker.remove()
            self._tracker = None

    def _batch_started(self, trainer: pl.Trainer) -> None: ...

    def _batch_ending(self, trainer: pl.Trainer, outputs: STEP_OUTPUT) -> bool:
        return False

    def _log_step(self, trainer: pl.Trainer, step: int) -> None: ...

    def _write_steps(self, trainer: pl.Trainer, wait: bool) -> bool:
        return False

    def _steps_in_flight(self) -> bool:
        return False

    def _load_state(self, state: dict[str, Any]) -> None: ...

    def _agreement_flags(self) -> list[bool]:
        return []

    def _votes_carried(self) -> bool:
        """Whether each batch's loss collective carries the ranks' failures and stops."""
        return False

    def _agreed(self, trainer: pl.Trainer, step: int, counts: list[int]) -> bool:
        return False


guard_hooks(HookCallback)


def training_loss(trainer: pl.Trainer, outputs: STEP_OUTPUT) -> torch.Tensor | None:
    """``training_step``'s loss in the user's units: under automatic optimization Lightning
    hands the batch-end hooks the loss divided by ``accumulate_grad_batches`` (what the backward
    saw), and the alarms quote losses as the user logs them."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if not isinstance(loss, torch.Tensor):
        return None
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    module = getattr(trainer, "lightning_module", None)
    if accumulate > 1 and getattr(module, "automatic_optimization", False):
        return loss.detach() * accumulate
    return loss


def _save(trainer: pl.Trainer) -> None:
    """Write the dashboard (rank 0) and save the loggers if any of ours wrote since."""
    if trainer not in _UNSAVED:
        return
    _UNSAVED.discard(trainer)
    if trainer.is_global_zero:
        write_dashboards(trainer.loggers)
    save_loggers(trainer.loggers)


def check_every_n_steps(owner: str, every_n_steps: int | None) -> int | None:
    """A cadence: a positive int or ``None`` (``ValueError`` naming ``owner`` else)."""
    if every_n_steps is None:
        return None
    try:
        return positive_int(owner, "every_n_steps", every_n_steps)
    except TypeError as err:  # one error type for every wrong cadence
        raise ValueError(
            f"{owner}(every_n_steps={every_n_steps!r}): must be a positive int or None "
            f"(the Trainer's log_every_n_steps), got {every_n_steps!r}"
        ) from err
