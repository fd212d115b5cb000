"""The lifecycle every callback shares: attach in ``on_train_start``, detach on every exit."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Protocol

import pytorch_lightning as pl
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities import rank_zero_warn
from typing_extensions import override

from lightning_hooks.core.checks import positive_int
from lightning_hooks.core.guard import Guard, guard_hooks
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.logging import save_loggers, shows_pictures, write_dashboards


class _Removable(Protocol):
    def remove(self) -> None: ...


class _Gate(Protocol):
    sampled: bool


__all__ = ["HookCallback", "check_every_n_steps"]

_UNSAVED: weakref.WeakSet[pl.Trainer] = weakref.WeakSet()
"""The trainers whose loggers one of our callbacks wrote to since they were last saved."""


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


def check_every_n_steps(owner: str, every_n_steps: int | None) -> int | None:
    """Validate a cadence argument: a positive int or ``None``, named with its owner in the error.

    Example:
        >>> check_every_n_steps("GradFlowCallback", 4)
        4
        >>> check_every_n_steps("GradFlowCallback", None) is None
        True
    """
    if every_n_steps is None:
        return None
    try:
        return positive_int(owner, "every_n_steps", every_n_steps)
    except TypeError as err:  # one error type for every wrong cadence, as before
        raise ValueError(
            f"{owner}(every_n_steps={every_n_steps!r}): must be a positive int or None "
            f"(the Trainer's log_every_n_steps), got {every_n_steps!r}"
        ) from err


# Strategies whose sharded statistics are not made whole: refused at setup. FSDP2 (Lightning's
# ModelParallelStrategy with fully_shard) is supported, data parallel only: see _check_strategy.
_REFUSED_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy")
_FSDP2 = (
    "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) with fully_shard "
    "applied in configure_model (FSDP2; HSDP on a 2-D (replicate, shard) mesh)"
)


def _check_strategy(owner: str, strategy: object) -> None:
    """Refuse the strategies whose statistics would be a shard's or a replica's, naming FSDP2."""
    names = {c.__name__ for c in type(strategy).__mro__}  # both Lightning namespaces, subclasses
    name = type(strategy).__name__
    if names & set(_REFUSED_STRATEGIES):
        raise MisconfigurationException(
            f"{owner} does not support Trainer(strategy={name}): parameters are sharded across "
            f"ranks and their statistics are not made whole there. Use {_FSDP2}, strategy='ddp' "
            "or a single device (see the README's support matrix)."
        )
    tensor_parallel = getattr(strategy, "_tensor_parallel_size", 1)
    if "ModelParallelStrategy" in names and tensor_parallel != 1:
        raise MisconfigurationException(
            f"{owner} does not support {name}(tensor_parallel_size={tensor_parallel!r}): ranks of "
            "a tensor-parallel group see the same batch and shards of each activation, so "
            f"per-layer statistics would be wrong. Supported: {_FSDP2}."
        )


class HookCallback(_CallbackBase):
    """Base of the library's callbacks: owns when hooks exist, subclasses own what they measure.

    Hooks are registered in ``on_train_start`` (after the sanity check) and removed in
    ``on_train_end``, ``on_exception`` and ``teardown``: Lightning runs neither of the last two
    hooks' siblings after an exception, so each of them removes, idempotently. A second ``fit``
    starts from a clean slate. Subclasses implement :meth:`_attach`, :meth:`_detach` and
    :meth:`_log_epoch`.

    Checkpoints: :meth:`state_dict` holds :meth:`_save_state` (the epoch so far, reduced across
    ranks, on the host); :meth:`load_state_dict` keeps it until the hooks are attached, then
    :meth:`_load_state` hands it to the fresh accumulators (under DDP to rank 0 only, so the next
    reduce counts it once). A state saved for other layers is dropped with one warning.
    FSDP1 and DeepSpeed are refused at setup, and so is tensor parallelism; FSDP2 (Lightning's
    ``ModelParallelStrategy`` with ``fully_shard``) is supported.
    """

    uses_images: bool = True
    _tracker: _Removable | None = None
    _pending_state: dict[str, Any] | None = None
    every_n_steps: int | None = None
    """Cadence: measure optimizer steps ``n-1, 2n-1, ...`` (the steps at which Lightning logs
    ``self.log`` values when ``n`` is ``log_every_n_steps``) and the first step of every epoch
    (1: every step; ``None``: the Trainer's ``log_every_n_steps``, 50 by default). Each measured
    step is a logging point: its values are written at that step, under ``..._step`` tags.
    Off-sample steps cost a Python attribute check per hook; epoch aggregates are then over the
    sampled steps, and an epoch shorter than ``n`` steps still has one."""
    _epoch_start_step: int = -1
    _idle: bool = False
    """Set by :meth:`_nothing_to_watch`: the model has nothing to watch, this fit does nothing."""
    _default_types: Any = None
    """The ``types`` of the default selection (an explicit ``types=`` differs from it)."""
    _selection_arguments: tuple[str, ...] = ("include", "exclude")
    """The constructor arguments, besides ``types``, that narrow the selection."""
    _measured_step: int | None = None
    strict: bool | None = None
    """``True``: an exception in one of the callback's hooks propagates; ``False``: it disables
    the callback for the rest of the fit with one warning; ``None``: ``LIGHTNING_HOOKS_STRICT``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        guard_hooks(cls)

    def _hook_guard(self) -> Guard:
        """This fit's guard of the callback's hooks (see :mod:`lightning_hooks.core.guard`)."""
        guard: Guard | None = self.__dict__.get("_guard")
        if guard is None:
            guard = self.__dict__["_guard"] = Guard(type(self).__name__, strict=self.strict)
        return guard

    def _guard_disable(self) -> None:
        """After a guarded failure: remove every hook now; the guard keeps the rest off."""
        self._detach()

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

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        measured = self._measured_step
        if measured is not None and trainer.global_step > measured:
            # The measured step's optimizer step ran (its last micro-batch): a logging point.
            # The last one's copy (CUDA: posted a step or more ago) is written first.
            self._measured_step = None
            self._read_steps(trainer, wait=True)
            self._log_step(trainer, measured)
            self._read_steps(trainer, wait=False)
        self._end_round(trainer)

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
        """What makes this instance's checkpoint state distinct (the module selection)."""
        return {
            "types": repr(getattr(self, "types", None)),
            "include": getattr(self, "include", ()),
            "exclude": getattr(self, "exclude", ()),
        }

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.__dict__.pop("_guard", None)  # each fit starts healthy
        name = type(self).__name__
        _check_strategy(name, trainer.strategy)
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
        self._idle = False
        self._validate(pl_module)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()
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
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
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
        block for it); the loggers are saved at the end of the hook round (:meth:`_end_round`)."""
        if self._write_steps(trainer, wait):
            _UNSAVED.add(trainer)

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
            if isinstance(cb, HookCallback) and cb._hook_guard().failed is None
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
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        try:
            self._read_steps(trainer, wait=True)  # CUDA: the last logging step's copy
            self._save(trainer)
        finally:
            self._release()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._release()

    def _release(self) -> None:
        """The run is over: remove the hooks, and let go of the LightningModule's ``log`` and
        ``log_dict``, which Lightning binds to every callback at the start of each run (and binds
        again at the next) and which would otherwise keep the model alive after ``fit``."""
        self._detach()
        for bound in ("log", "log_dict"):
            self.__dict__.pop(bound, None)

    def _is_last_hook_callback(self, trainer: pl.Trainer) -> bool:
        ours = [cb for cb in trainer.callbacks if isinstance(cb, HookCallback)]  # type: ignore[attr-defined]
        return not ours or ours[-1] is self

    def _validate(self, pl_module: pl.LightningModule) -> None:
        """Check the configuration against the model before training starts."""

    def _explicit_selection(self) -> str:
        """The selection arguments given other values than their defaults, as ``name=value``."""
        types = getattr(self, "types", None)
        given = [f"types={types!r}"] if types is not None and types != self._default_types else []
        for name in self._selection_arguments:
            value = getattr(self, name, None)
            if value:
                given.append(f"{name}={value!r}")
        return ", ".join(given)

    def _nothing_to_watch(self, what: str, hint: str = "") -> None:
        """The selection holds no ``what``: an explicit selection is the user's mistake and
        raises, naming its arguments; at the defaults, one warning and this fit does nothing
        (as Lightning's ``LearningRateMonitor`` without a scheduler).

        Raises:
            ValueError: a selection argument was given.
        """
        name = type(self).__name__
        given = self._explicit_selection()
        if given:
            raise ValueError(f"{name}({given}): selects no {what} of the model{hint}")
        rank_zero_warn(
            f"{name}: the model has no {what} to watch at the defaults; this callback does "
            f"nothing in this fit{hint}",
            category=LightningHooksWarning,
        )
        self._idle = True

    def _attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    def _detach(self) -> None:
        """Remove the tracker's hooks and drop it (idempotent); override to keep state first."""
        if self._tracker is not None:
            self._tracker.remove()
            self._tracker = None

    def _log_step(self, trainer: pl.Trainer, step: int) -> None:
        """A logging point: end the window of the steps measured since the last one (post its
        one host copy); :meth:`_write_steps` writes it at ``step`` once the copy is done."""

    def _write_steps(self, trainer: pl.Trainer, wait: bool) -> bool:
        """Write the windows whose copies are done (``wait``: block for them); whether any was."""
        return False

    def _log_epoch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise NotImplementedError

    def _save_state(self) -> dict[str, Any]:
        """The statistics so far, reduced across ranks, on the host (every rank calls it)."""
        return {}

    def _load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`_save_state` into freshly attached accumulators; ValueError if foreign."""


guard_hooks(HookCallback)
