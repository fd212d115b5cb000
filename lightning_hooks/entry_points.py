"""Switched on without code: Lightning's ``callbacks_factory`` entry points, read from
``LIGHTNING_HOOKS``.

The package registers :func:`callbacks` in ``pytorch_lightning.callbacks_factory``,
``lightning.pytorch.callbacks_factory``, ``lightning_fabric.callbacks_factory`` and
``lightning.fabric.callbacks_factory``: every ``Trainer`` and every ``Fabric`` calls it when
it is built. It returns nothing unless ``LIGHTNING_HOOKS`` is set::

    LIGHTNING_HOOKS=grad_flow python train.py
    LIGHTNING_HOOKS=grad_flow,dead_relu litgpt pretrain ...
    LIGHTNING_HOOKS=all python train.py

A callback of a class the user passed already is not added twice (the added one stands down).

Example:
    >>> requested("grad_flow, DeadReLUCallback")
    ['GradFlowCallback', 'DeadReLUCallback']
    >>> requested("")
    []
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["ENV", "SHORT_NAMES", "callbacks", "requested"]

ENV = "LIGHTNING_HOOKS"
"""The environment variable: a comma-separated list of callbacks, by short or class name."""

SHORT_NAMES: dict[str, str] = {
    "grad_flow": "GradFlowCallback",
    "activation_stats": "ActivationStatsCallback",
    "dead_relu": "DeadReLUCallback",
    "saturation": "SaturationCallback",
    "layer_time": "LayerTimeCallback",
    "feature_map": "FeatureMapCallback",
}
"""Short name -> class name of every callback that builds with no argument."""

_ALL = ("grad_flow", "activation_stats", "dead_relu", "saturation")
"""``all``: the callbacks on by default (not the timing, nor the image-heavy feature maps)."""


def requested(value: str) -> list[str]:
    """The class names ``value`` (``LIGHTNING_HOOKS``'s) asks for, in order, each once.

    Raises:
        ValueError: a name that is no callback, naming the allowed values.

    Example:
        >>> requested("all")
        ['GradFlowCallback', 'ActivationStatsCallback', 'DeadReLUCallback', 'SaturationCallback']
        >>> requested("grad_fow")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: LIGHTNING_HOOKS='grad_fow': 'grad_fow' is no callback; allowed ...: all, ...
    """
    by_class = {name: name for name in SHORT_NAMES.values()}
    names: list[str] = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        if item == "all":
            names.extend(SHORT_NAMES[short] for short in _ALL)
            continue
        name = SHORT_NAMES.get(item) or by_class.get(item)
        if name is None:
            allowed = ", ".join(["all", *SHORT_NAMES])
            raise ValueError(
                f"{ENV}={value!r}: {item!r} is no callback; allowed (comma-separated): {allowed}, "
                f"or their class names {', '.join(SHORT_NAMES.values())}"
            )
        names.append(name)
    return list(dict.fromkeys(names))


def callbacks() -> list[Any]:
    """The callbacks ``LIGHTNING_HOOKS`` asks for, at their defaults (none when it is unset):
    the factory of every entry point. Each is marked as added by the environment, so that it
    stands down when the user passed one of its class."""
    import lightning_hooks

    added = []
    for name in requested(os.environ.get(ENV, "")):
        callback = getattr(lightning_hooks, name)()
        callback._from_environment = True
        added.append(callback)
    return added
