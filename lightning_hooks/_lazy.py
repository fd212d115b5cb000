"""Lazy public names for a package (PEP 562): its modules load on first attribute access."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, where: Mapping[str, str], public: Sequence[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``where`` maps a public name to its module.

    The first access imports the module and caches the name in the package's namespace.

    Example:
        >>> getattr_, dir_ = lazy_names("lightning_hooks", {"X": "os.path"}, ["X"])
        >>> getattr_("nothing")
        Traceback (most recent call last):
        ...
        AttributeError: module 'lightning_hooks' has no attribute 'nothing'
    """

    def get(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        vars(sys.modules[package])[name] = value
        return value

    def listing() -> list[str]:
        return sorted({*vars(sys.modules[package]), *public})

    return get, listing
