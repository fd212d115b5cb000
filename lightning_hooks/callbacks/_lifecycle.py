"""When a callback's hooks exist: setup, attach, checkpoints, the ranks' agreement, release.

:class:`Lifecycle` is the lowest of the three pieces of
:class:`~lightning_hooks.callbacks._base.HookCallback` (lifecycle, writing, cadence): it attaches
in ``on_train_start`` and removes the hooks on every exit, owns the guard, and agrees with the
other ranks on a failure and on a stop. Its selection, checked against the model before
training starts, is :class:`~lightning_hooks.callbacks._watching.Watching`'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import pytorch_lightning as pl
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities import rank_zero_warn
from typing_extensions import override

from lightning_hooks.callbacks._checks import check_strategy
from lightning_hooks.callbacks._dispatch import restore_inherited, skip_inherited
from lightning_hooks.callbacks._watching import Watching
from lightning_hooks.core.hooks.guard import Guard, guard_hooks
from lightning_hooks.core.transport.distributed import agree, gather_objects, world_size
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.logging import shows_pictures

__all__ = ["Lifecycle"]


class _Removable(Protocol):
    def remove(self) -> None: ...


def _callback_bases() -> tuple[type, ...]:
    """``pytorch_lightning.Callback``, and ``lightning.pytorch.Callback`` when installed.

    Each namespace's ``LightningCLI`` (jsonargparse) accepts in ``trainer.callbacks`` only
    subclasses of its own ``Callback``: deriving from both lets either CLI configure ours.
    """
    try:
        from lightning.pytorch import Callback as LightningCallback
    except ImportError:
        return (pl.Callback,)
    return tuple(dict.fromkeys((pl.Callback, LightningCallback)))  # once, were they one class


if TYPE_CHECKING:
    _CallbackBase = pl.Callback
else:
    _CallbackBase = type("_CallbackBase", _callback_bases(), {"__module__": __name__})


class Lifecycle(Watching, _CallbackBase):
    """Hooks registered in ``on_train_start`` (after the sanity check), removed in
    ``on_train_end``, ``on_exception`` and ``teardown`` (each idempotently); a checkpoint's state
    kept until the hooks are attached; the guard and the ranks' agreement (see
    :class:`~lightning_hooks.callbacks._base.HookCallback`). The selection is checked against
    the model in ``on_fit_start`` (:class:`~lightning_hooks.callbacks._watching.Watching`)."""

    uses_images: bool = True
    _tracker: _Removable | None = None
    _pending_state: dict[str, Any] | None = None
    _ranks: int = 1
    """The processes of this fit (set in ``on_train_start``): above 1, ranks agree on a
    failure and on a stop (:meth:`_agree`)."""
    _from_environment: bool = False
    """Added by ``LIGHTNING_HOOKS`` (``entry_points.py``): stands down in a fit whose callbacks
    hold one of its class that the user passed."""
    strict: bool | None = None
    """``True``: an exception in one of the callback's hooks propagates; ``False``: it disables
    the callback for the rest of the fit with one warning; ``None``: ``LIGHTNING_HOOKS_STRICT``."""

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

    @property
    @override
    def state_key(self) -> str:
        """Unique per configuration: two instances watching different modules do not collide.

        Made once: Lightning reads it for every hook it calls (its profiler's action names).
        """
        key: str | None = self.__dict__.get("_cached_state_key")
        if key is None:
            key = self._generate_state_key(**self._state_key_fields())
            self.__dict__["_cached_state_key"] = key
        return key

    def _state_key_fields(self) -> dict[str, Any]:
        """What makes this instance's checkpoint state distinct (the module selection; one
        added by ``LIGHTNING_HOOKS`` beside the user's, which Lightning refuses at init else)."""
        fields = {
            "types": repr(getattr(self, "types", None)),
            "include": getattr(self, "include", ()),
            "exclude": getattr(self, "exclude", ()),
        }
        return {**fields, "environment": True} if self._from_environment else fields

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or _passed_by_user(self, trainer.callbacks):  # type: ignore[attr-defined]
            return
        self.__dict__.pop("_guard", None)  # each fit starts healthy
        name = type(self).__name__
        check_strategy(name, trainer.strategy)
        if not trainer.loggers:
            raise MisconfigurationException(
                f"{name} needs a logger, but the Trainer has none (logger=False). "
                "Use Trainer(logger=TensorBoardLogger(...)) or leave logger at its default."
            )
        if self.uses_images and not shows_pictures(trainer.loggers):
            rank_zero_warn(
                f"{name}: no logger that shows pictures among the Trainer's loggers; scalars go "
                f"to {[type(lg).__name__ for lg in trainer.loggers]}, images need TensorBoard, "
                "W&B, MLflow or CSV.",
                category=LightningHooksWarning,
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # After ``configure_model``, which Lightning calls after ``setup``: layers built there
        # (its recipe for FSDP and large models) exist now. Still before the first batch.
        self._idle = _passed_by_user(self, trainer.callbacks)  # type: ignore[attr-defined]
        if not self._idle:
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
        pending, self._pending_state = self._pending_state, None
        if pending:
            try:
                self._load_state(pending)
            except (KeyError, ValueError) as err:
                rank_zero_warn(
                    f"{type(self).__name__}: the checkpoint's statistics do not match this model "
                    f"and are dropped ({err})",
                    category=LightningHooksWarning,
                )

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._save_state()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending_state = dict(state_dict)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A failure after the last epoch end is agreed here, so that rank 0 names it.
        if self._hook_guard().failed is None:
            self._agree(trainer, trainer.global_step, always=True)
        self._detach()

    def _agree(self, trainer: pl.Trainer, step: int, *, always: bool = False) -> bool:
        """At a logging point (``always``: an epoch end) of a multi-process run, agree with the
        other ranks on a deferred failure and a ``stop`` (one small ``all_reduce``, read on the
        host), unless a collective of every batch carries them (:meth:`_carried`); whether the
        callback is now disabled on every rank."""
        guard = self._hook_guard()
        if self._ranks == 1 or guard.failed is not None or (self._carried() and not always):
            return guard.failed is not None
        failed, stopping, *extra = agree(
            [guard.local is not None, self._wants_stop(), *self._agreement_flags()]
        )
        disabled = self._settle(trainer, step, failed, stopping)
        return disabled or self._agreed(trainer, step, extra)

    def _agreement_flags(self) -> list[bool]:
        """Extend: more flags for the ranks' agreement (each counted over the ranks)."""
        return []

    def _agreed(self, trainer: pl.Trainer, step: int, counts: list[int]) -> bool:
        """Extend: act on the counts of :meth:`_agreement_flags` (every rank, the same);
        whether the callback is now disabled on every rank."""
        return False

    def _fail_everywhere(
        self, trainer: pl.Trainer, step: int, where: str, error: Exception
    ) -> bool:
        """An error every rank met alike (computed from what the ranks exchanged): raise if
        strict, else disable the callback on every rank now, one warning on rank 0."""
        guard = self._hook_guard()
        if guard.strict:
            raise error
        cause = f"{where}: {type(error).__name__}: {error}"
        guard.settle([cause] * self._ranks, step, warn=trainer.is_global_zero)  # every rank's
        guard.take_pending()
        self._guard_disable()
        return True

    def _settle(self, trainer: pl.Trainer, step: int, failed: int, stopping: int) -> bool:
        """Act on the ranks' agreement at ``step``: stop every rank if any asked; when one
        failed, disable the callback on every rank now (one warning on rank 0 names each failed
        rank, its hook and its error: one ``all_gather_object``). Whether it is disabled."""
        if stopping:
            trainer.should_stop = True
            self._stop_agreed()
        if not failed:
            return False
        guard = self._hook_guard()
        guard.settle(gather_objects(guard.local), step, warn=trainer.is_global_zero)
        guard.take_pending()
        self._guard_disable()
        return True

    def _carried(self) -> bool:
        """Whether a collective of every batch carries the agreement (then the logging points
        make none of their own)."""
        return False

    def _wants_stop(self) -> bool:
        """Whether this rank asks every rank to stop (an alarm's ``stop``, not yet agreed)."""
        return False

    def _stop_agreed(self) -> None:
        """The ranks agreed to stop: forget this rank's request."""

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:
            self._flush(trainer)
        finally:
            self._release()

    def _flush(self, trainer: pl.Trainer) -> None:
        """On an exception, before the hooks go: write what was measured (see ``_writing.py``)."""

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    def _release(self) -> None:
        """The run is over: remove the hooks, and let go of the LightningModule's ``log`` and
        ``log_dict``, which Lightning binds to every callback at the start of each run (and binds
        again at the next) and which would otherwise keep the model alive after ``fit``."""
        self._detach()
        restore_inherited(self)
        for bound in ("log", "log_dict"):
            self.__dict__.pop(bound, None)

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    def _detach(self) -> None:
        """Remove the tracker's hooks and drop it (idempotent); override to keep state first."""
        if self._tracker is not None:
            self._tracker.remove()
            self._tracker = None

    def _save_state(self) -> dict[str, Any]:
        """The statistics so far, reduced across ranks, on the host (every rank calls it)."""
        return {}

    def _load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`_save_state` into freshly attached accumulators; ValueError if foreign."""


guard_hooks(Lifecycle)


def _passed_by_user(callback: Lifecycle, callbacks: list[Any]) -> bool:
    """Whether ``callback`` came from ``LIGHTNING_HOOKS`` and ``callbacks`` hold one of its class
    that did not (the user's: it is not added twice)."""
    return callback._from_environment and any(
        isinstance(other, type(callback)) and not getattr(other, "_from_environment", False)
        for other in callbacks
    )
