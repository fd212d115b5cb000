"""Callbacks switched on without code, from ``LIGHTNING_HOOKS``.

:func:`callbacks` is the ``callbacks_factory`` entry point every ``Trainer`` and ``Fabric`` calls
when built.
"""

from __future__ import annotations

import os
from typing import Any

from lightning_hooks.switch import ENV, SHORT_NAMES, requested

__all__ = ["ENV", "SHORT_NAMES", "callbacks", "requested"]


def callbacks() -> list[Any]:
    """Build the callbacks ``LIGHTNING_HOOKS`` asks for, at their defaults.

    Each is marked as added by the environment, so that it gives way to the user's own.

    Returns:
        The callbacks, in the order ``LIGHTNING_HOOKS`` names them (empty where it is unset).

    Raises:
        ValueError: ``LIGHTNING_HOOKS`` names something that is no callback (see
            :func:`~lightning_hooks.switch.requested`).
    """
    from lightning_hooks import callbacks as classes

    added = []
    for name in requested(os.environ.get(ENV, "")):
        callback = getattr(classes, name)()
        callback.mark_from_environment()
        added.append(callback)
    return added
