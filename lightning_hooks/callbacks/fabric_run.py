"""The run that drives a callback in a Fabric loop, in the Trainer's place, and what it needs.

A :class:`FabricRun`, started by the callback's :class:`~.fabric.FabricHooks` at
``fabric.setup``, takes the callback's place among Fabric's callbacks and calls its Trainer
hooks, listed by :class:`FabricDriven`, with a :class:`FabricTrainer` in place of the Trainer.
Here too are :func:`check_fabric`, which refuses what cannot run under Fabric (the strategies
supported and refused, and ``UNDER_FABRIC``, what works instead), the protocols the run reads
of the callback, the stand-in left by a callback that gave way to the user's own, and Fabric's
clipping methods the run observes. See ``docs/fabric.md``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, TypeGuard, runtime_checkable

import torch
from lightning_fabric import Fabric
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_hooks.callbacks.cadence import LIGHTNING_LOG_EVERY_N_STEPS
from lightning_hooks.callbacks.trainer import (
    SHARDED_STRATEGIES,
    TrainerView,
    defers_to_users_own,
    gradient_clipping,
    inherits_empty_hook,
)
from lightning_hooks.core.hooks.guard import Guard
from lightning_hooks.core.hooks.registry import wrap_step_closure
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.internals.lightning import (
    before_fabric_clips,
    fabric_callbacks,
    fabric_wrapped_module,
    unwrapped_optimizer,
)

__all__ = [
    "UNDER_FABRIC",
    "BatchHooks",
    "FabricChecked",
    "FabricDriven",
    "FabricRun",
    "FabricTrainer",
    "FitHooks",
    "RunHolder",
    "StateHooks",
    "check_fabric",
]

_SUPPORTED_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy")
# strategies under which a statistic would be a shard's or a replica's: the Trainer's sharded
# ones, model and data parallelism, and Fabric's XLA ones
_REFUSED_STRATEGIES = SHARDED_STRATEGIES | {
    "ModelParallelStrategy",
    "DataParallelStrategy",
    "XLAStrategy",
    "XLAFSDPStrategy",
}
UNDER_FABRIC = (
    "GradFlowCallback, ActivationStatsCallback, DeadReLUCallback and SaturationCallback run under "
    "Fabric."
)
"""What a refusal of a callback that needs a Trainer says works instead."""


class FabricChecked(Protocol):
    """What :func:`check_fabric` reads of a callback: why its configuration cannot run there."""

    fabric_refusal: str | None
    """Why the callback's configuration cannot run in a Fabric loop (``None``: it can)."""


class FitHooks(Protocol):
    """The Trainer hooks that begin and end a fit, which a :class:`FabricRun` calls too."""

    def setup(self, trainer: TrainerView, pl_module: nn.Module, stage: str) -> None:
        """Start a fit: its checks and its new state."""

    def on_fit_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Check the watched module, which may leave the fit nothing to watch."""

    def on_train_start(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Put the fit's hooks on the module, for the optimizers the trainer knows."""

    def on_train_end(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """End the fit and remove its module hooks."""

    def teardown(self, trainer: TrainerView, pl_module: nn.Module, stage: str) -> None:
        """Take the fit off the module, whatever happened before."""


class StateHooks(Protocol):
    """The Trainer hooks of a checkpoint's state.

    A run attached again mid-epoch carries its epoch so far through them.
    """

    def state_dict(self) -> dict[str, Any]:
        """Return the fit's state, as a checkpoint saves it."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hold a saved state, which the next attach restores."""


class BatchHooks(Protocol):
    """The Trainer hooks of each batch and epoch, which a :class:`FabricRun` calls too."""

    def on_train_batch_start(
        self, trainer: TrainerView, pl_module: nn.Module, batch: object, batch_idx: int
    ) -> None:
        """Start a batch: the cadence decides whether it belongs to a logging step."""

    def on_train_batch_end(
        self,
        trainer: TrainerView,
        pl_module: nn.Module,
        outputs: STEP_OUTPUT,
        batch: object,
        batch_idx: int,
    ) -> None:
        """End a batch whose optimizer step has run, and write a logging step's values."""

    def on_train_epoch_end(self, trainer: TrainerView, pl_module: nn.Module) -> None:
        """Write the epoch's aggregates."""


class FabricDriven(FabricChecked, FitHooks, StateHooks, BatchHooks, Protocol):
    """What a :class:`FabricRun` calls on the callback it drives.

    Beside the guard, these are Lightning's Trainer hooks (:class:`FitHooks`,
    :class:`StateHooks` and :class:`BatchHooks`), each with the contract of its namesake in
    ``pytorch_lightning.Callback``.
    The run hands each hook a :class:`FabricTrainer` as ``trainer`` and the watched module as
    ``pl_module``, so the hooks are typed by what they read of these: a
    :class:`~.trainer.TrainerView` and a plain ``nn.Module``. ``on_before_optimizer_step`` is
    not here: only some callbacks define it, and the run looks for it once, when it starts
    (:class:`_StepObserver`).
    """

    def hook_guard(self) -> Guard:
        """Return the guard of the running fit, which the run's own hooks run under."""


class _StepObserver(Protocol):
    """A callback that defines its own ``on_before_optimizer_step``."""

    def on_before_optimizer_step(
        self, trainer: TrainerView, pl_module: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        """Observe the gradients ``optimizer`` is about to apply."""


def _observes_steps(callback: object) -> TypeGuard[_StepObserver]:
    """Return whether ``callback`` defines its own ``on_before_optimizer_step``.

    A callback that inherits Lightning's empty default has nothing to observe there, so the run
    does not call it, as Lightning's Trainer skips it (:func:`~.trainer.skip_inherited`).

    Args:
        callback: the callback the run drives.

    Returns:
        Whether its class defines the hook, which then takes what the run hands every hook.
    """
    return not inherits_empty_hook(callback, "on_before_optimizer_step")


class _GaveWay:
    """Stands in Fabric's callback list for a callback that gave way to the user's own.

    It has no hook, so ``fabric.call`` passes it by.

    Args:
        name: the class name of the callback that gave way.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        """Name the callback that gave way."""
        return f"<{self.name} added by LIGHTNING_HOOKS, giving way to the user's own>"


@runtime_checkable
class RunHolder(Protocol):
    """A callback that holds the run driving it, which the run lets go of at its end."""

    fabric_run: FabricRun | None
    """The run that drives the callback in a Fabric loop, from ``fabric.setup`` to its release."""


class _FabricStrategy:
    """The one attribute of a Trainer's strategy that the callbacks read, over Fabric's.

    Args:
        precision_plugin: Fabric's precision, whose ``scaler`` (a GradScaler, or none) is read.
    """

    def __init__(self, precision_plugin: object) -> None:
        self.precision_plugin = precision_plugin


class FabricTrainer:
    """Stands in for the Trainer in a Fabric loop, with what the callbacks read from a Trainer.

    It satisfies :class:`~.trainer.TrainerView`, the type of every hook's ``trainer``, and reads
    its precision, loggers and rank from a ``Fabric``.

    Its steps are the watched module's optimizer steps, its epochs the calls of
    ``on_train_epoch_end``. It has no fit loop: an epoch's values are written at the epoch's last
    optimizer step, ``global_step - 1`` (:func:`~.attached.epoch_step`). That is where the Trainer
    puts them for a loop that steps once a batch, and where the epoch's last logging step, if it
    is that step, is written too.

    Args:
        fabric: the Fabric whose precision, loggers and rank the trainer reports.
        callback: the one callback in the trainer's ``callbacks``.
        module: the module Fabric set up, the trainer's ``lightning_module`` (a plain module
            optimizes as the loop says: no ``automatic_optimization``).
    """

    def __init__(self, fabric: Fabric, callback: FabricDriven, module: nn.Module) -> None:
        self.strategy = _FabricStrategy(fabric.strategy.precision)
        self.callbacks = [callback]
        self.global_step = 0
        self.current_epoch = 0
        self.should_stop = False
        self.log_every_n_steps = LIGHTNING_LOG_EVERY_N_STEPS  # where ``every_n_steps`` is ``None``
        self.loggers = list(fabric.loggers)
        self.is_global_zero = bool(fabric.is_global_zero)
        self.optimizers: list[torch.optim.Optimizer] = []
        self.gradient_clip_val: float | None = None
        self.gradient_clip_algorithm: str | None = None
        self.accumulate_grad_batches = 1  # a Fabric loop steps when it wants: its loss is as given
        self.lightning_module = module


def check_fabric(callback: FabricChecked, fabric: Fabric) -> None:
    """Refuse what a callback cannot do under Fabric, naming why and what works.

    Args:
        callback: the callback to run under Fabric; its ``fabric_refusal`` is checked.
        fabric: the Fabric whose strategy and loggers are checked.

    Raises:
        MisconfigurationException: the callback's configuration cannot run under Fabric, the
            strategy is not supported, or the Fabric has no logger.
    """
    name = type(callback).__name__
    if callback.fabric_refusal is not None:
        raise MisconfigurationException(
            f"{name} does not work under Fabric: {callback.fabric_refusal}"
        )
    strategy = type(fabric.strategy)
    mro = {c.__name__ for c in strategy.__mro__}
    if mro & _REFUSED_STRATEGIES or not mro & set(_SUPPORTED_STRATEGIES):
        raise MisconfigurationException(
            f"{name} under Fabric supports strategy in ('auto' on one device, 'ddp'), got "
            f"{strategy.__name__}: under FSDP, DeepSpeed and model parallelism the parameters are "
            "sharded and their statistics are not made whole there; under DataParallel each "
            "replica sees part of the batch."
        )
    if not fabric.loggers:
        raise MisconfigurationException(
            f"{name} needs a logger, but the Fabric has none. Use "
            "Fabric(loggers=[TensorBoardLogger(...)]) (lightning.fabric.loggers)."
        )


_CLIPS = (
    ("clip_gradients_norm", "norm", "max_norm"),
    ("clip_gradients_value", "value", "clip_val"),
)


class _FirstEvaluation:
    """A step's closure that calls ``after`` once, after its first evaluation.

    LBFGS evaluates its closure several times in one step; the gradients of the first are the
    step's, as Lightning's Trainer reads them.

    Args:
        optimizer: the optimizer stepping, which ``after`` is called with.
        after: observes the gradients the closure made.
        closure: the step's closure.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        after: Callable[[torch.optim.Optimizer], None],
        closure: Callable[[], Any],
    ) -> None:
        self.optimizer = optimizer
        self.after = after
        self.closure = closure
        self.evaluated = False

    def __call__(self) -> Any:  # noqa: ANN401 (the closure's loss, as the optimizer takes it)
        """Evaluate the closure; after its first evaluation, observe the gradients."""
        result = self.closure()
        if not self.evaluated:
            self.evaluated = True
            self.after(self.optimizer)
        return result


class FabricRun:
    """Runs a callback that watches a module of one Fabric loop, in place of the Trainer's hooks.

    Args:
        callback: the callback, driven through its Trainer hooks with a :class:`FabricTrainer`
            in the Trainer's place.
        fabric: the Fabric whose strategy, precision and loggers the run reads.
        module: the module Fabric set up (the user's is taken from inside Fabric's wrapper).

    Raises:
        MisconfigurationException: :func:`check_fabric` refuses the callback under ``fabric``.
    """

    def __init__(self, callback: FabricDriven, fabric: Fabric, module: nn.Module) -> None:
        check_fabric(callback, fabric)
        self.callback = callback
        self.fabric = fabric
        self.module: nn.Module = fabric_wrapped_module(module)
        self.trainer = FabricTrainer(fabric, callback, self.module)
        self._params = {id(p) for p in self.module.parameters()}
        self._owned: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self._observed: set[int] = set()  # optimizers observed before their clip, this step
        self._loss: Any = None
        self._attached = False
        self._undo: list[Callable[[], None]] = []
        self._warned_module = False
        self._step_observer: _StepObserver | None = None
        self._after_closure: Callable[[torch.optim.Optimizer], None] = self.before_step
        if _observes_steps(callback):
            self._step_observer = callback

    @classmethod
    def take_over(
        cls, callback: FabricDriven, fabric: Fabric, module: nn.Module
    ) -> FabricRun | None:
        """Drive ``callback`` in a Fabric loop, in its place among Fabric's callbacks.

        ``fabric.call(...)`` then reaches the run, which answers with Fabric's arguments and
        drives the callback's Trainer hooks. A callback added by ``LIGHTNING_HOOKS`` gives way
        when the user already passed one of its class.

        Args:
            callback: the callback ``fabric.setup`` called.
            fabric: the Fabric whose callback list the run takes the callback's place in.
            module: the module Fabric set up, which the run hooks.

        Returns:
            The run, started; ``None`` where the callback gives way.
        """
        callbacks = fabric_callbacks(fabric)
        ours = [c.callback if isinstance(c, FabricRun) else c for c in callbacks or ()]
        if defers_to_users_own(callback, ours):
            if callbacks is not None and callback in callbacks:
                # fabric.call would hand its Trainer hooks Fabric's arguments. Replaced, not
                # removed: Fabric is iterating over the list while it calls this hook.
                callbacks[callbacks.index(callback)] = _GaveWay(type(callback).__name__)
            return None
        run = cls(callback, fabric, module)
        if callbacks is not None and callback in callbacks:
            callbacks[callbacks.index(callback)] = run
        run.start()
        return run

    def start(self) -> None:
        """Run the callback's set-up checks, and arm the pre-step and clipping hooks.

        The hooks stay armed until :meth:`on_train_end`; a run garbage-collected first leaves no
        global hook behind.
        """
        self.callback.setup(self.trainer, self.module, "fit")
        self.callback.on_fit_start(self.trainer, self.module)
        ref = weakref.ref(self)

        def pre_step(
            optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
            """Pass an optimizer about to step to the run, while the run exists.

            Args:
                optimizer: the optimizer about to step (torch's global pre-step hook sees every
                    one).
                args: the step's positional arguments (the optimizer first), where a closure
                    may be.
                kwargs: the step's keyword arguments, where a closure may be.

            Returns:
                The step's arguments with its closure wrapped (see :meth:`before_step_call`),
                or ``None`` to leave them as they are.
            """
            run = ref()
            return None if run is None else run.before_step_call(optimizer, args, kwargs)

        def observe(optimizer: torch.optim.Optimizer) -> None:
            """Pass an optimizer whose closure was just evaluated to the run, while it exists.

            Args:
                optimizer: the optimizer about to apply the closure's gradients.
            """
            run = ref()
            if run is not None:
                run.before_step(optimizer)

        guard = self.callback.hook_guard()  # the guard of this fit, made anew by its setup
        handle = register_optimizer_step_pre_hook(guard.wrap(pre_step, "optimizer step pre-hook"))
        self._after_closure = guard.wrap(observe, "optimizer closure")
        self._undo.append(handle.remove)
        weakref.finalize(self, handle.remove)  # a run garbage-collected leaves no global hook
        for attribute, algorithm, argument in _CLIPS:
            self._wrap_clip(ref, attribute, algorithm, argument)

    def _wrap_clip(
        self, ref: weakref.ref[FabricRun], method: str, algorithm: str, argument: str
    ) -> None:
        """Observe the gradients before ``fabric.clip_gradients`` clips them, until released.

        Args:
            ref: a weak reference to the run, so that the wrapper keeps no run alive.
            method: the strategy's clipping method wrapped (``"clip_gradients_norm"``).
            algorithm: the clipping algorithm the method applies (``"norm"`` or ``"value"``).
            argument: the name of the method's bound argument (``"max_norm"``).
        """

        def observe(optimizer: Any, value: Any) -> None:  # noqa: ANN401 (as Fabric hands them on)
            """Observe the gradients about to be clipped, while the run lives.

            Args:
                optimizer: the optimizer whose gradients are clipped, as Fabric hands it on.
                value: the clip bound, as Fabric hands it on.
            """
            run = ref()
            if run is not None:
                run.before_clip(optimizer, algorithm, value)

        guarded = self.callback.hook_guard().wrap(observe, "gradient clipping hook")

        def before(optimizer: Any, value: Any) -> None:  # noqa: ANN401 (as Fabric hands them on)
            """Check the clipping, then observe it under the callback's guard.

            Args:
                optimizer: the optimizer whose gradients are clipped, as Fabric hands it on.
                value: the clip bound, as Fabric hands it on.
            """
            run = ref()
            if run is not None:
                run.check_clip(optimizer, value)  # a refused setup raises, outside the guard
            guarded(optimizer, value)

        self._undo.append(before_fabric_clips(self.fabric.strategy, method, argument, before))

    def _owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Return whether ``optimizer`` steps a parameter of the watched module.

        The answer is cached per optimizer.

        Args:
            optimizer: the optimizer, unwrapped from Fabric's.

        Returns:
            Whether any of its parameters belongs to the watched module.
        """
        owned = self._owned.get(optimizer)
        if owned is None:
            params = (p for group in optimizer.param_groups for p in group["params"])
            owned = any(id(p) in self._params for p in params)
            self._owned[optimizer] = owned
        return owned

    def check_clip(self, optimizer: Any, value: Any) -> None:  # noqa: ANN401 (the optimizer and the clip value as Fabric hands them on)
        """Refuse ``fabric.clip_gradients`` with a GradScaler.

        Under a GradScaler the gradients are still scaled before the clip, so the pre-clip norm
        cannot be read there.

        Args:
            optimizer: the optimizer whose gradients are clipped, as Fabric hands it on.
            value: the clip bound (``None``: no clipping, nothing to refuse).

        Raises:
            MisconfigurationException: the watched module's gradients are clipped under a
                GradScaler.
        """
        optimizer = unwrapped_optimizer(optimizer)
        if not self._owns(optimizer) or value is None:
            return
        if getattr(self.fabric.strategy.precision, "scaler", None) is not None:
            raise MisconfigurationException(
                f"{type(self.callback).__name__} under Fabric: fabric.clip_gradients with a "
                "GradScaler (precision='16-mixed') is not supported: the gradients are still "
                "scaled before the clip, so the pre-clip norm cannot be read there. Use "
                "precision='bf16-mixed' or clip without the callback."
            )

    def before_clip(self, optimizer: Any, algorithm: str, value: Any) -> None:  # noqa: ANN401 (as check_clip)
        """Observe the gradients ``fabric.clip_gradients`` is about to clip.

        A new bound or algorithm is recorded as the trainer's clipping, which the alarms read at
        each step. Where the clipping begins, the fit attaches again to measure after it; a
        changed bound keeps the fit and what it measured.

        Args:
            optimizer: the optimizer whose gradients are clipped, as Fabric hands it on.
            algorithm: the clipping algorithm (``"norm"`` or ``"value"``).
            value: the clip bound (``None``: no clipping, nothing observed).
        """
        optimizer = unwrapped_optimizer(optimizer)
        if not self._owns(optimizer) or value is None:
            return
        trainer = self.trainer
        began = gradient_clipping(trainer) is None
        trainer.gradient_clip_val = float(value)
        trainer.gradient_clip_algorithm = algorithm
        if began and gradient_clipping(trainer) is not None and self._attached:
            self._start()  # the clipping began: measured after it from now on
        self.before_step(optimizer)
        self._observed.add(id(optimizer))

    def before_step_call(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Observe an optimizer about to step, or its closure's first evaluation.

        A step given a closure (LBFGS) evaluates it inside the step, so the gradients before
        the step are the previous step's: the closure is wrapped, and the gradients are observed
        after its first evaluation, where Lightning's Trainer observes them.

        Args:
            optimizer: the optimizer about to step.
            args: the step's positional arguments: the optimizer, then the closure if passed
                by position.
            kwargs: the step's keyword arguments.

        Returns:
            The step's arguments with the closure wrapped; ``None`` where the step has no
            closure or the optimizer is not the watched module's (it is observed now, or not).
        """
        wrapped = None
        if self._owns(optimizer):
            wrapped = wrap_step_closure(
                args, kwargs, partial(_FirstEvaluation, optimizer, self._after_closure)
            )
        if wrapped is None:
            self.before_step(optimizer)
        return wrapped

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Observe the gradients an optimizer of the watched module is about to apply.

        An optimizer seen for the first time joins the trainer's optimizers and the fit attaches
        again; one observed before its clip this step is not observed twice.

        Args:
            optimizer: the optimizer about to step.
        """
        if not self._owns(optimizer):
            return
        if id(optimizer) in self._observed:  # observed before its clip
            self._observed.discard(id(optimizer))
            return
        new = optimizer not in self.trainer.optimizers
        if new:
            self.trainer.optimizers.append(optimizer)
        if new or not self._attached:
            self._start()
        if self._step_observer is not None:
            self._step_observer.on_before_optimizer_step(self.trainer, self.module, optimizer)

    def _start(self) -> None:
        """Attach (again) for the optimizers known, and start the coming step's batch.

        Attached again (an optimizer or the clipping joined), the fit carries its epoch so far:
        the callback's state is taken first and restored by the new attach, as a checkpoint's.
        """
        if self._attached:
            self.callback.load_state_dict(self.callback.state_dict())
        self.callback.on_train_start(self.trainer, self.module)
        self._attached = True
        self._batch_start()

    def _batch_start(self) -> None:
        """Start the coming step's batch, whose module hooks the cadence puts on or not."""
        # A batch index other than 0: Fabric has no epochs, so the cadence alone picks the steps.
        step = self.trainer.global_step
        self.callback.on_train_batch_start(self.trainer, self.module, None, step + 1)

    def on_after_optimizer_step(self, strategy: object, optimizer: torch.optim.Optimizer) -> None:
        """Count an optimizer step, end its batch, and start the next one.

        Fabric calls this hook after each optimizer step.

        Args:
            strategy: Fabric's strategy, unread.
            optimizer: the optimizer that stepped; one of another module is ignored.
        """
        if not self._attached or not self._owns(optimizer):
            return
        self.trainer.global_step += 1
        loss = self._loss
        self._loss = None
        step = self.trainer.global_step - 1
        self.callback.on_train_batch_end(self.trainer, self.module, loss, None, step)
        self._batch_start()

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """Keep the loss of ``fabric.call("on_before_backward", loss)`` for the loss rules.

        The step's last loss is the one read, at the optimizer step.

        Args:
            loss: the loss about to be backpropagated (detached where it is a tensor).
        """
        self._loss = loss.detach() if isinstance(loss, torch.Tensor) else loss

    def on_train_epoch_end(self) -> None:
        """Log the epoch's aggregates at ``fabric.call("on_train_epoch_end")``.

        They are written at the epoch's last optimizer step (see :class:`FabricTrainer`).
        """
        if self._attached:
            self.callback.on_train_epoch_end(self.trainer, self.module)
        self.trainer.current_epoch += 1

    def on_train_end(self) -> None:
        """Write what is pending and remove every hook at ``fabric.call("on_train_end")``."""
        callback = self.callback
        trainer = self.trainer
        if self._attached:
            callback.on_train_end(trainer, self.module)
        callback.teardown(trainer, self.module, "fit")
        self._attached = False
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if isinstance(callback, RunHolder) and callback.fabric_run is self:
            # The callback the user keeps holds no Fabric, model or optimizer after its run.
            callback.fabric_run = None

    def on_after_setup(self, fabric: Fabric, module: nn.Module) -> None:
        """Warn once that the module of a second ``fabric.setup`` is not watched.

        Args:
            fabric: the Fabric that set the module up, unread.
            module: the module set up; the first module set up is the one watched.
        """
        inner = fabric_wrapped_module(module)
        if inner is not self.module and not self._warned_module:
            self._warned_module = True
            rank_zero_warn(
                f"{type(self.callback).__name__} under Fabric watches the first module set up "
                f"({type(self.module).__name__}); {type(inner).__name__} is not "
                "watched. Pass one callback per Fabric.",
                category=LightningHooksWarning,
            )
