"""The typical size of an update, re-exported from :mod:`.grouped_norms` (its module)."""

from lightning_hooks.core.kernels.grouped_norms import typical_update

__all__ = ["typical_update"]
