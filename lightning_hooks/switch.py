"""The names ``LIGHTNING_HOOKS`` takes, and the callbacks they switch on.

These are the callbacks it can switch on without code, by short or class name, and ``all``.
Torch-free, so that ``lightning-hooks --help`` lists them without importing the training code;
:mod:`~lightning_hooks.entry_points` builds the callbacks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ENV", "SHORT_NAMES", "requested", "state_key_fields"]

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
    """Return the class names ``value`` (``LIGHTNING_HOOKS``'s) asks for, in order, each once.

    Args:
        value: the variable's text: a comma-separated list of short names, class names or
            ``all`` (blank items are skipped; ``all`` is the callbacks on by default).

    Returns:
        The callbacks' class names, in the order first asked for, without repeats.

    Raises:
        ValueError: a name that is no callback, naming the allowed values.

    Example:
        >>> requested("all")
        ['GradFlowCallback', 'ActivationStatsCallback', 'DeadReLUCallback', 'SaturationCallback']
        >>> requested("grad_flow, DeadReLUCallback"), requested("")
        (['GradFlowCallback', 'DeadReLUCallback'], [])
    """
    names: list[str] = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        shorts = _ALL if item == "all" else (item,)
        names.extend(SHORT_NAMES.get(short, short) for short in shorts)
        if names[-1] not in SHORT_NAMES.values():
            allowed = ", ".join(["all", *SHORT_NAMES])
            raise ValueError(
                f"{ENV}={value!r}: {item!r} is no callback; allowed (comma-separated): {allowed}, "
                f"or their class names {', '.join(SHORT_NAMES.values())}"
            )
    return list(dict.fromkeys(names))


def state_key_fields(fields: Mapping[str, Any], *, from_environment: bool) -> dict[str, Any]:
    """Return the fields of a callback's checkpoint key, with one more if the switch added it.

    The switch may add a callback beside the user's own of the same configuration. Lightning
    refuses two callbacks with one key, so the one the switch added gets a field of its own, and
    the two never share their checkpoint state.

    Args:
        fields: the fields that tell the callback's configuration apart.
        from_environment: whether ``LIGHTNING_HOOKS`` added the callback, not the user.

    Returns:
        ``fields``, with ``environment=True`` where the switch added the callback.

    Example:
        >>> state_key_fields({"include": ()}, from_environment=True)
        {'include': (), 'environment': True}
        >>> state_key_fields({"include": ()}, from_environment=False)
        {'include': ()}
    """
    if from_environment:
        return {**fields, "environment": True}
    return dict(fields)
