"""The first-non-finite probe, re-exported from :mod:`~lightning_hooks.core.transport.readback`
(its module)."""

from lightning_hooks.core.transport.readback import FirstNonFinite

__all__ = ["FirstNonFinite"]
