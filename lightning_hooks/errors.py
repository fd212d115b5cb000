"""The library's warning and exception types."""

from __future__ import annotations

__all__ = ["LightningHooksError", "LightningHooksWarning"]


class LightningHooksWarning(UserWarning):
    """Every warning the library emits: filter them with this one category."""


class LightningHooksError(RuntimeError):
    """Raised by the library when training must not go on."""
