"""Constructor argument checks shared by the callbacks: each error names the culprit."""

from __future__ import annotations

import numbers

from lightning_fabric.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_hooks.core.alarms import AlarmRules
from lightning_hooks.core.checks import positive_int
from lightning_hooks.core.hooks.selection import ModuleTypes

__all__ = [
    "check_alarms",
    "check_every_n_steps",
    "check_max_layers",
    "check_strategy",
    "check_types",
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
# ModelParallelStrategy with fully_shard) is supported, data parallel only: see check_strategy.
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
