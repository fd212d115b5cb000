"""Running the callbacks under Lightning's Trainer.

This covers what the callbacks read of a Trainer (:class:`TrainerView`), the checks the Trainer
must pass at setup, both Lightning namespaces (``pytorch_lightning`` and
``lightning.pytorch``), a callback added by ``LIGHTNING_HOOKS`` yielding to the user's own, and
the empty per-batch hooks Lightning need not call. Fabric's loop is handled in
:mod:`~lightning_hooks.callbacks.fabric` (a callback's entry points) and
:mod:`~lightning_hooks.callbacks.fabric_run` (the run that drives it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol, TypeGuard

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities import rank_zero_warn
from torch import nn

from lightning_hooks import internals
from lightning_hooks.core.clipping import Clip
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.internals.lightning import shadow_hooks, tensor_parallel_size, unshadow_hooks
from lightning_hooks.logging import shows_pictures
from lightning_hooks.logging.sinks import LightningLogger

__all__ = [
    "PER_BATCH_HOOKS",
    "SECOND_CALLBACK",
    "SHARDED_STRATEGIES",
    "FitProgress",
    "GradientSettings",
    "TrainerView",
    "TrainingSetup",
    "check_trainer",
    "defers_to_users_own",
    "gradient_clipping",
    "inherits_empty_hook",
    "lightning_module_of",
    "loss_scales",
    "restore_inherited",
    "skip_inherited",
]

SHARDED_STRATEGIES = frozenset({"FSDPStrategy", "DeepSpeedStrategy"})
"""The strategies, by class name, that shard parameters without making their statistics whole
(Lightning's FSDP and DeepSpeed): refused by the Trainer and by Fabric alike."""

_NAMESPACES: tuple[tuple[type, type], ...] = ((pl.Trainer, pl.Callback),)  # (Trainer, Callback)
_LIGHTNING_MODULES: tuple[type, ...] = (pl.LightningModule,)
with contextlib.suppress(ImportError):
    from lightning.pytorch import Callback as _LightningCallback
    from lightning.pytorch import LightningModule as _LightningModule
    from lightning.pytorch import Trainer as _LightningTrainer

    _NAMESPACES += ((_LightningTrainer, _LightningCallback),)
    _LIGHTNING_MODULES += (_LightningModule,)


# ``lightning.pytorch.Callback`` if installed and distinct, else ``object`` (each namespace's
# ``LightningCLI`` accepts only its own ``Callback``: ours derive from both).
SECOND_CALLBACK: type = object if _NAMESPACES[-1][1] is pl.Callback else _NAMESPACES[-1][1]


class _StrategyView(Protocol):
    """What the callbacks read from a Trainer's strategy: its precision plugin."""

    @property
    def precision_plugin(self) -> object:
        """Return the precision plugin, whose ``scaler`` (a GradScaler, or none) is read."""


class FitProgress(Protocol):
    """Where the fit is, and where its values go: what every callback reads of its Trainer."""

    should_stop: bool
    """Whether the fit stops at the end of this step; an alarm's ``stop`` and the ranks'
    agreement on a stop set it."""

    @property
    def global_step(self) -> int:
        """Return how many optimizer steps the fit has taken: the step the running batch feeds."""

    @property
    def current_epoch(self) -> int:
        """Return the running epoch, counted from 0."""

    @property
    def loggers(self) -> Sequence[LightningLogger]:
        """Return the loggers every value is written to."""

    @property
    def is_global_zero(self) -> bool:
        """Return whether this is rank 0, the one that draws pictures and writes text."""


class TrainingSetup(Protocol):
    """What is trained and how: the module, its optimizers and the strategy that runs them."""

    @property
    def lightning_module(self) -> nn.Module:
        """Return the module trained, whose ``automatic_optimization`` is read where it has one."""

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]:
        """Return the optimizers whose steps the gradient flow reads."""

    @property
    def strategy(self) -> _StrategyView:
        """Return the strategy, whose precision plugin may hold a GradScaler.

        :func:`check_trainer` also reads its class and its tensor-parallel size, to refuse a
        strategy whose statistics would be a shard's.
        """


class GradientSettings(Protocol):
    """How the Trainer treats the gradient before a step: its clipping and accumulation."""

    @property
    def gradient_clip_val(self) -> float | None:
        """Return the gradient clipping bound (``None``: no clipping)."""

    @property
    def gradient_clip_algorithm(self) -> str | None:
        """Return the gradient clipping algorithm, ``"norm"`` or ``"value"`` (``None``: norm)."""

    @property
    def accumulate_grad_batches(self) -> int:
        """Return how many batches make one optimizer step, which a batch's loss is divided by."""


class TrainerView(FitProgress, TrainingSetup, GradientSettings, Protocol):
    """What the callbacks read from the Trainer that their hooks are handed.

    The same hooks run under Lightning's Trainer and in a Fabric loop, where a
    :class:`~lightning_hooks.callbacks.fabric_run.FabricTrainer` stands in for the Trainer. The
    hooks, and the collaborators they hand the trainer to, are typed by this view rather than by
    ``pl.Trainer``, so that the stand-in takes the Trainer's place as it is: the Trainers of both
    of Lightning's namespaces and the stand-in each satisfy it. It is made of three small
    contracts: :class:`FitProgress`, which every callback reads; :class:`TrainingSetup` and
    :class:`GradientSettings`, which the gradient flow and its alarms read. A member is
    read-only where Lightning's Trainer makes it a property; ``should_stop`` alone is written.

    Two more attributes are read and are not members: Lightning sets ``log_every_n_steps`` and
    ``callbacks`` on its Trainer outside the class, so a type checker does not find them on
    ``pl.Trainer``, and as members they would make a ``pl.Trainer`` fail the type check where a
    hook is called with one. ``log_every_n_steps``, read with ``getattr``, is the cadence of a
    callback that takes the Trainer's (:class:`~.cadence.LoggingCadence`, :func:`check_trainer`);
    ``callbacks`` tells a callback added by ``LIGHTNING_HOOKS`` at its ``setup`` whether the user
    passed their own.
    """


_FSDP2 = (
    "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) with fully_shard "
    "applied in configure_model (FSDP2; HSDP on a 2-D (replicate, shard) mesh)"
)


def check_trainer(
    name: str, trainer: TrainerView, *, uses_images: bool, every_n_steps: int | None
) -> None:
    """Refuse a Trainer the callback cannot work under, and warn where its pictures are not shown.

    A strategy whose statistics would be a shard's is refused, as is a Trainer with no logger, or
    with no logging steps for a callback that takes the Trainer's (``every_n_steps=None``).

    Args:
        name: the callback's name, which the messages begin with.
        trainer: the trainer whose strategy, loggers and ``log_every_n_steps`` are checked.
        uses_images: the callback draws pictures: warn if no logger of the Trainer shows them.
        every_n_steps: the callback's cadence (``None``: the Trainer's, which is then checked).

    Raises:
        MisconfigurationException: the strategy is FSDP, DeepSpeed or tensor-parallel, the
            Trainer has no logger, or it has no logging steps for a callback that takes the
            Trainer's.
    """
    if every_n_steps is None:
        _check_cadence(name, trainer)
    strategy = type(trainer.strategy).__name__
    names = {c.__name__ for c in type(trainer.strategy).__mro__}  # both namespaces, subclasses
    if names & SHARDED_STRATEGIES:
        raise MisconfigurationException(
            f"{name} does not support Trainer(strategy={strategy}): parameters are sharded "
            f"across ranks and their statistics are not made whole there. Use {_FSDP2}, "
            "strategy='ddp' or a single device (see the README's support matrix)."
        )
    tensor_parallel = tensor_parallel_size(trainer.strategy)
    if "ModelParallelStrategy" in names and tensor_parallel != 1:
        raise MisconfigurationException(
            f"{name} does not support {strategy}(tensor_parallel_size={tensor_parallel!r}): "
            "ranks of a tensor-parallel group see the same batch and shards of each activation, "
            f"so per-layer statistics would be wrong. Supported: {_FSDP2}."
        )
    if not trainer.loggers:
        raise MisconfigurationException(
            f"{name} needs a logger, but the Trainer has none (logger=False). "
            "Use Trainer(logger=TensorBoardLogger(...)) or leave logger at its default."
        )
    if uses_images and not shows_pictures(trainer.loggers):
        rank_zero_warn(
            f"{name}: no logger that shows pictures among the Trainer's loggers; scalars go "
            f"to {[type(lg).__name__ for lg in trainer.loggers]}, images need TensorBoard, "
            "W&B, MLflow or CSV.",
            category=LightningHooksWarning,
        )


def _check_cadence(name: str, trainer: TrainerView) -> None:
    """Refuse ``Trainer(log_every_n_steps=0)`` for a callback that takes its logging steps from it.

    Lightning reads 0 as no step logging; a callback has nothing without logging steps (its epoch
    aggregates are over them), and read as a cadence, 0 would measure every step, the most
    expensive setting.

    Args:
        name: the callback's name, which the message begins with.
        trainer: the trainer whose ``log_every_n_steps`` is checked.

    Raises:
        MisconfigurationException: the Trainer's ``log_every_n_steps`` is 0.
    """
    if getattr(trainer, "log_every_n_steps", None) == 0:  # set by Lightning, not typed
        raise MisconfigurationException(
            f"{name}(every_n_steps=None) measures at the Trainer's logging steps, but "
            "Trainer(log_every_n_steps=0) has none: its epoch aggregates are over logging "
            "steps, and it never measures every step unasked. Give the callback a cadence of its "
            f"own, {name}(every_n_steps=N) with N a positive int, or set "
            "Trainer(log_every_n_steps=N) with N > 0 (Lightning's default is 50)."
        )


def lightning_module_of(owner: str, module: nn.Module) -> pl.LightningModule:
    """Return the module a Trainer-only callback is handed, as the LightningModule it is.

    The hooks take a plain ``nn.Module``, as a Fabric loop hands them its module. A callback that
    Fabric refuses (its ``fabric_refusal``) runs under Lightning's Trainer only, whose module is a
    LightningModule of either namespace, and reads what only a LightningModule has: its
    ``device``, and the user's ``forward_fn`` that takes one.

    Args:
        owner: the callback's name, which the error begins with.
        module: the module the callback's hook was handed.

    Returns:
        ``module``, typed as the LightningModule it is.

    Raises:
        TypeError: ``module`` is not a LightningModule (a Fabric loop refuses such callbacks
            before this can happen).
    """
    if _is_lightning_module(module):
        return module
    raise TypeError(
        f"{owner} runs under Lightning's Trainer only and reads its LightningModule, got "
        f"{type(module).__name__}"
    )


def _is_lightning_module(module: nn.Module) -> TypeGuard[pl.LightningModule]:
    """Return whether ``module`` is a LightningModule of either of Lightning's namespaces.

    Args:
        module: the module asked about.

    Returns:
        Whether it is one (``lightning.pytorch``'s is typed as ``pytorch_lightning``'s, whose
        members it shares).
    """
    return isinstance(module, _LIGHTNING_MODULES)


def defers_to_users_own(callback: object, callbacks: Sequence[object]) -> bool:
    """Return whether ``callback`` gives way to the user's own.

    Args:
        callback: one of the library's callbacks.
        callbacks: every callback of the Trainer or Fabric, searched for one of its class the
            user passed.

    Returns:
        Whether ``callback`` came from ``LIGHTNING_HOOKS`` (its ``from_environment``) and the
        user passed one of its class among ``callbacks``: then the user's own is the one that
        runs.
    """
    return _from_environment(callback) and any(
        isinstance(other, type(callback)) and not _from_environment(other) for other in callbacks
    )


def _from_environment(callback: object) -> bool:
    """Return whether the ``LIGHTNING_HOOKS`` switch added ``callback``.

    Args:
        callback: any callback; one without ``from_environment`` is the user's.

    Returns:
        The callback's ``from_environment``, ``False`` where it has none.
    """
    return bool(getattr(callback, "from_environment", False))


# Lightning calls every per-batch hook of every callback, even the empty defaults: for the fit,
# the internals' speed-up shadows those a callback inherits (not those its class defines).
_STAGES = ("train", "validation", "test", "predict")
PER_BATCH_HOOKS = (
    *(f"on_{stage}_batch_{end}" for stage in _STAGES for end in ("start", "end")),
    *("on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step"),
)
_TRAINERS = tuple(trainer for trainer, _ in _NAMESPACES)
_DEFAULTS = {name: {getattr(base, name) for _, base in _NAMESPACES} for name in PER_BATCH_HOOKS}


def inherits_empty_hook(callback: object, name: str) -> bool:
    """Return whether a callback leaves the per-batch hook ``name`` to Lightning's empty default.

    Args:
        callback: the callback asked about; its class is read, not its instance.
        name: one of :data:`PER_BATCH_HOOKS`.

    Returns:
        Whether its class inherits the hook from ``Callback`` of either Lightning namespace.
    """
    return getattr(type(callback), name, None) in _DEFAULTS[name]


def skip_inherited(callback: pl.Callback, trainer: object) -> tuple[str, ...]:
    """Let Lightning skip the empty per-batch hooks a callback inherits, under Lightning's Trainer.

    A Fabric loop is left alone. See
    :func:`~lightning_hooks.internals.lightning.shadow_hooks`.

    Args:
        callback: the callback whose inherited, empty per-batch hooks are shadowed for the fit.
        trainer: the trainer of the fit; only a Trainer of either Lightning namespace is acted
            on.

    Returns:
        The hooks shadowed, for :func:`restore_inherited`.
    """
    if not isinstance(trainer, _TRAINERS):
        return ()
    inherited = [name for name in PER_BATCH_HOOKS if inherits_empty_hook(callback, name)]
    return shadow_hooks(callback, inherited)


def restore_inherited(callback: pl.Callback, shadowed: Sequence[str]) -> None:
    """Let Lightning call a callback's inherited hooks again; calling it twice does no harm.

    Args:
        callback: the callback whose hooks :func:`skip_inherited` shadowed.
        shadowed: the hooks :func:`skip_inherited` returned.
    """
    unshadow_hooks(callback, shadowed)


def loss_scales(
    trainer: TrainingSetup, optimizer: torch.optim.Optimizer
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Return the AMP loss scale, and the scale ``optimizer``'s gradients still carry.

    Under fp16 AMP the gradients carry the GradScaler's loss scale until it unscales them.
    Lightning calls ``scaler.unscale_`` before ``on_before_optimizer_step``, except for fused
    optimizers, which unscale inside their ``step()``: their ``.grad`` still carries the scale,
    which the measurements divide out themselves. The scale is read on the device, with no
    host sync.

    Args:
        trainer: the trainer, whose strategy's precision plugin may hold a ``scaler``.
        optimizer: the optimizer about to step.

    Returns:
        ``(grad_scale, param_grad_scale)``: the loss scale (``None`` without an enabled
        GradScaler), and the same scale where the gradients still carry it, else ``None``.
    """
    scaler: torch.amp.GradScaler | None = getattr(trainer.strategy.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None, None
    scale = internals.grad_scaler_scale(scaler)
    if scale is not None and internals.steps_unscale_themselves(optimizer):
        return scale, scale
    return scale, None


def gradient_clipping(trainer: GradientSettings) -> Clip | None:
    """Return the gradient clipping the Trainer applies, or ``None`` without one.

    Args:
        trainer: the trainer, whose ``gradient_clip_val`` and ``gradient_clip_algorithm`` are
            read. Lightning's algorithm is an enum whose value is ``"norm"`` or ``"value"``.

    Returns:
        The bound and the algorithm's name.
    """
    bound = trainer.gradient_clip_val
    if not bound:
        return None
    # Read at every optimizer step, so not checked again: Lightning checked the Trainer's
    # arguments, and its algorithm is "norm" or "value" (Fabric's clip methods name theirs).
    algorithm = trainer.gradient_clip_algorithm or "norm"
    name = str(getattr(algorithm, "value", algorithm))
    return Clip(float(bound), "value" if name == "value" else "norm")
