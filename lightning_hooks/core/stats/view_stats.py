"""The name :class:`~lightning_hooks.core.stats.optimizer_view.ViewStats` was imported by."""

from __future__ import annotations

from lightning_hooks.core.stats.optimizer_view import ViewStats

__all__ = ["ViewStats"]
