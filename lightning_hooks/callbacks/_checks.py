"""Constructor argument checks shared by the callbacks: each error names the culprit."""

from __future__ import annotations

from torch import nn

from lightning_hooks.core.hooks.selection import ModuleTypes

__all__ = ["check_types"]


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
