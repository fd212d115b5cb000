"""Lightning's logger classes, from its Trainer's two namespaces and Fabric's two."""

from __future__ import annotations

import functools
import importlib

__all__ = ["lightning_types"]

# Fabric's loggers last: the Trainer's TensorBoardLogger and CSVLogger subclass them.
_NAMESPACES = (
    "pytorch_lightning.loggers",
    "lightning.pytorch.loggers",
    "lightning_fabric.loggers",
    "lightning.fabric.loggers",
)


@functools.cache
def lightning_types(name: str) -> tuple[type, ...]:
    """The class ``name`` from ``pytorch_lightning.loggers``, ``lightning.pytorch.loggers`` and
    Fabric's ``lightning_fabric.loggers`` and ``lightning.fabric.loggers``, whichever are
    installed: an ``isinstance`` against one namespace's class silently misses the others'.

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
