"""Names a package loads on first use (PEP 562), so that importing it stays cheap: the
package ``lightning_hooks`` and its core load Lightning, matplotlib and TensorBoard only when a
name that needs them is used."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence

__all__ = ["lazy_names"]


def lazy_names(
    package: str, where: Mapping[str, str], public: Sequence[str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``where`` maps a public name to its module,
    imported on first access; the name is then cached in the package's namespace."""

    def get(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        vars(sys.modules[package])[name] = value
        return value

    def listing() -> list[str]:
        return sorted({*vars(sys.modules[package]), *public})

    return get, listing
