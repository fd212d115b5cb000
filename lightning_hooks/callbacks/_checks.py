"""Constructor argument checks shared by the callbacks: each error names the culprit."""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from lightning_hooks.core.selection import ModuleTypes

__all__ = ["UNSET", "check_types", "renamed"]


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()
"""The default of a deprecated keyword: tells "not passed" from any value, ``None`` included."""


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


def renamed(owner: str, old: str, new: str, how: str, *, stacklevel: int = 3) -> None:
    """Warn (``DeprecationWarning``, at the caller's caller) that ``old`` is now ``new``.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     renamed("Cb", "warn", "warn_at", "warn=False is warn_at=None")
        >>> print(caught[0].message)
        Cb(warn=...) is deprecated and will be removed: use warn_at (warn=False is warn_at=None)
    """
    warnings.warn(
        f"{owner}({old}=...) is deprecated and will be removed: use {new} ({how})",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
