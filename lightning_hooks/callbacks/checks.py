"""What a callback checks and arranges before it runs, and what its ranks agree on.

Arguments, the Trainer's strategy and loggers, and the selection are checked (each error names
the culprit). At the logging steps of a multi-process run the ranks agree on a failure and on a
stop (:func:`agree_ranks`).

Lightning calls every per-batch hook of every callback inside a profiler context, even
``Callback``'s empty defaults, but skips an attribute that is not callable. So, for the fit, each
inherited per-batch hook is shadowed by ``None`` on the instance (:func:`skip_inherited`); hooks
the class defines, hooks Lightning calls directly and attributes others set are left alone.
"""

from __future__ import annotations

import numbers
from typing import Any

import pytorch_lightning as pl
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities import rank_zero_warn
from torch import nn
from torch.nn.parameter import is_lazy

from lightning_hooks.core.alarms import AlarmRules
from lightning_hooks.core.checks import positive_int
from lightning_hooks.core.hooks.selection import ModuleTypes
from lightning_hooks.core.transport import agree, gather_objects
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.logging import shows_pictures

_NAMESPACES: tuple[tuple[type, type], ...] = ((pl.Trainer, pl.Callback),)
"""The installed Lightning namespaces, as ``(Trainer, Callback)``."""
try:
    from lightning.pytorch import Callback as _LightningCallback
    from lightning.pytorch import Trainer as _LightningTrainer

    _NAMESPACES += ((_LightningTrainer, _LightningCallback),)
except ImportError:
    pass

__all__ = [
    "PER_BATCH_HOOKS",
    "agree_ranks",
    "check_alarms",
    "check_every_n_steps",
    "check_max_layers",
    "check_strategy",
    "check_trainer",
    "check_types",
    "fail_everywhere",
    "lazy_parameters",
    "nothing_to_watch",
    "passed_by_user",
    "restore_inherited",
    "second_callback",
    "settle",
    "skip_inherited",
]


def check_types(owner: str, types: ModuleTypes) -> None:
    """Raise ``TypeError`` unless ``types`` is ``None``, an ``nn.Module`` subclass or a tuple.

    Example:
        >>> check_types("Cb", 3)
        Traceback (most recent call last):
        ...
        TypeError: Cb(types=3): expected an nn.Module subclass or a tuple of them, got 3
    """
    items = types if isinstance(types, tuple) else (types,)
    for t in items:
        if t is not None and not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(
                f"{owner}(types={types!r}): expected an nn.Module subclass or a tuple of them, "
                f"got {t!r}"
            )


def check_every_n_steps(owner: str, every_n_steps: int | None) -> int | None:
    """Validate a cadence: a positive int or ``None`` (``ValueError`` naming ``owner`` else).

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


# Sharded statistics are not made whole under these; FSDP2 (data parallel only) is supported.
_REFUSED_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy")
_FSDP2 = (
    "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1) with fully_shard "
    "applied in configure_model (FSDP2; HSDP on a 2-D (replicate, shard) mesh)"
)


def check_strategy(owner: str, strategy: object) -> None:
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


def second_callback() -> type:
    """``lightning.pytorch.Callback`` if installed and distinct, else ``object``: each
    namespace's ``LightningCLI`` accepts only its own ``Callback``, so ours derive from both."""
    second = _NAMESPACES[-1][1]
    return object if second is pl.Callback else second


def check_trainer(callback: Any, trainer: pl.Trainer) -> None:
    """At ``setup``: refuse an unsupported strategy or no logger; warn if no logger shows images.

    Raises:
        MisconfigurationException: an unsupported strategy, or no logger.
    """
    name = type(callback).__name__
    check_strategy(name, trainer.strategy)
    if not trainer.loggers:
        raise MisconfigurationException(
            f"{name} needs a logger, but the Trainer has none (logger=False). "
            "Use Trainer(logger=TensorBoardLogger(...)) or leave logger at its default."
        )
    if callback.uses_images and not shows_pictures(trainer.loggers):
        rank_zero_warn(
            f"{name}: no logger that shows pictures among the Trainer's loggers; scalars go "
            f"to {[type(lg).__name__ for lg in trainer.loggers]}, images need TensorBoard, "
            "W&B, MLflow or CSV.",
            category=LightningHooksWarning,
        )


def check_alarms(owner: str, alarms: AlarmRules | bool) -> AlarmRules | None:
    """The alarm rules asked for: ``True`` the defaults, ``False`` none; ``TypeError`` else.

    Example:
        >>> check_alarms("GradFlowCallback", False) is None
        True
    """
    if not isinstance(alarms, AlarmRules | bool):
        raise TypeError(
            f"{owner}(alarms={alarms!r}): expected an AlarmRules or a bool, "
            f"got {type(alarms).__name__}"
        )
    return AlarmRules() if alarms is True else alarms or None


def check_max_layers(owner: str, max_layers_logged: int | None) -> int | None:
    """Validate ``max_layers_logged``: a positive int or ``None``.

    Example:
        >>> check_max_layers("GradFlowCallback", 100)
        100
    """
    integral = isinstance(max_layers_logged, numbers.Integral)
    if max_layers_logged is not None and (
        not integral or isinstance(max_layers_logged, bool) or max_layers_logged < 1
    ):
        raise ValueError(
            f"{owner}(max_layers_logged={max_layers_logged!r}): must be a positive "
            f"int or None, got {max_layers_logged!r}"
        )
    return max_layers_logged


def nothing_to_watch(callback: Any, what: str, hint: str = "") -> None:
    """``callback``'s selection holds no ``what``: raise if the user gave a selection, else warn
    once and do nothing this fit.

    Raises:
        ValueError: a selection argument was given.
    """
    name = type(callback).__name__
    types = getattr(callback, "types", None)
    given = [f"types={types!r}"] if types is not None and types != callback._default_types else []
    given += [
        f"{argument}={value!r}"
        for argument in callback._selection_arguments
        if (value := getattr(callback, argument, None))
    ]
    if given:
        raise ValueError(f"{name}({', '.join(given)}): selects no {what} of the model{hint}")
    rank_zero_warn(
        f"{name}: the model has no {what} to watch at the defaults; this callback does "
        f"nothing in this fit{hint}",
        category=LightningHooksWarning,
    )
    callback._idle = True


def lazy_parameters(callback: Any, pl_module: nn.Module) -> bool:
    """Whether the model holds uninitialized lazy parameters (nothing can be laid out by their
    sizes): if so, one warning naming them, and ``callback`` does nothing this fit."""
    lazy = [n for n, p in pl_module.named_parameters() if is_lazy(p)]
    if lazy:
        rank_zero_warn(
            f"{type(callback).__name__}: the model's lazy parameters {lazy[:3]} are not "
            "initialized before fit; this callback does nothing in this fit. Initialize "
            "them first: one forward of a sample batch before trainer.fit (or in the "
            "LightningModule's setup)",
            category=LightningHooksWarning,
        )
        callback._idle = True
    return bool(lazy)


PER_BATCH_HOOKS = (
    "on_train_batch_start",
    "on_train_batch_end",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_validation_batch_start",
    "on_validation_batch_end",
    "on_test_batch_start",
    "on_test_batch_end",
    "on_predict_batch_start",
    "on_predict_batch_end",
)
"""The hooks Lightning calls per batch through ``_call_callback_hooks``."""

_SHADOWED = "_lightning_hooks_shadowed"


# The installed ``Trainer`` classes, and each hook's empty defaults in their ``Callback``.
_TRAINERS = tuple(trainer for trainer, _ in _NAMESPACES)
_DEFAULTS = {name: {getattr(base, name) for _, base in _NAMESPACES} for name in PER_BATCH_HOOKS}


def skip_inherited(callback: Any, trainer: Any) -> None:
    """Under Lightning's ``trainer``, shadow the inherited per-batch hooks with ``None`` until
    :func:`restore_inherited` (Fabric's loop calls ours by name: untouched)."""
    if not isinstance(trainer, _TRAINERS):
        return
    shadowed = []
    for name in PER_BATCH_HOOKS:
        if name not in callback.__dict__ and getattr(type(callback), name) in _DEFAULTS[name]:
            callback.__dict__[name] = None
            shadowed.append(name)
    callback.__dict__[_SHADOWED] = callback.__dict__.get(_SHADOWED, ()) + tuple(shadowed)


def restore_inherited(callback: Any) -> None:
    """Remove the shadows :func:`skip_inherited` set (idempotent)."""
    for name in callback.__dict__.pop(_SHADOWED, ()):
        if callback.__dict__.get(name, False) is None:
            del callback.__dict__[name]


def agree_ranks(callback: Any, trainer: pl.Trainer, step: int, always: bool) -> bool:
    """At a logging step (``always``: an epoch end) of a multi-process run, agree on a deferred
    failure and a ``stop`` (one small ``all_reduce``) unless every batch's collective carries
    them; whether the callback is now disabled on every rank."""
    guard = callback._hook_guard()
    if callback._ranks == 1 or guard.failed is not None or (callback._carried() and not always):
        return guard.failed is not None
    failed, stopping, *extra = agree(
        [guard.local is not None, callback._wants_stop(), *callback._agreement_flags()]
    )
    disabled = settle(callback, trainer, step, failed, stopping)
    return disabled or callback._agreed(trainer, step, extra)


def settle(callback: Any, trainer: pl.Trainer, step: int, failed: int, stopping: int) -> bool:
    """Act on the ranks' agreement: stop if any asked; if any failed, disable the callback on
    every rank (one warning on rank 0 names each rank's hook and error); whether disabled."""
    if stopping:
        trainer.should_stop = True
        callback._stop_agreed()
    if not failed:
        return False
    return _disable(callback, trainer, step, gather_objects(callback._hook_guard().local))


def fail_everywhere(
    callback: Any, trainer: pl.Trainer, step: int, where: str, error: Exception
) -> bool:
    """An error every rank met alike: raise if strict, else disable the callback everywhere."""
    guard = callback._hook_guard()
    if guard.strict:
        raise error
    cause = f"{where}: {type(error).__name__}: {error}"
    return _disable(callback, trainer, step, [cause] * callback._ranks)  # every rank's


def _disable(callback: Any, trainer: pl.Trainer, step: int, causes: list[Any]) -> bool:
    """Disable the callback on every rank, one warning on rank 0 naming each rank's cause."""
    guard = callback._hook_guard()
    guard.settle(causes, step, warn=trainer.is_global_zero)
    guard.take_pending()
    callback._guard_disable()
    return True


def passed_by_user(callback: Any, callbacks: list[Any]) -> bool:
    """Whether ``callback`` came from ``LIGHTNING_HOOKS`` and the user passed one of its class."""
    return callback._from_environment and any(
        isinstance(other, type(callback)) and not getattr(other, "_from_environment", False)
        for other in callbacks
    )
