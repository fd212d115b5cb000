"""Lightning's logger classes, from both of its namespaces."""

from __future__ import annotations

import functools
import importlib

__all__ = ["lightning_types"]

_NAMESPACES = ("pytorch_lightning.loggers", "lightning.pytorch.loggers")


@functools.cache
def lightning_types(name: str) -> tuple[type, ...]:
    """The class ``name`` from ``pytorch_lightning.loggers`` and ``lightning.pytorch.loggers``,
    whichever are installed: an ``isinstance`` against one namespace's class silently misses the
    other's loggers.

    Example:
        >>> [t.__module__ for t in lightning_types("CSVLogger")][0]
        'pytorch_lightning.loggers.csv_logs'
    """
    found: list[type] = []
    for namespace in _NAMESPACES:
        try:
            found.append(getattr(importlib.import_module(namespace), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)
