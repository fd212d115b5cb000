"""``ViewStats`` under its former module path: it is defined in :mod:`.optimizer_view`."""

from __future__ import annotations

from lightning_hooks.core.stats.optimizer_view import ViewStats

__all__ = ["ViewStats"]
