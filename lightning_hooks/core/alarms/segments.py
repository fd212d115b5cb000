"""The quiet step's fold of per-parameter norms into layer rows, under its former import path:
:class:`HostSegments` lives in :mod:`lightning_hooks.core.alarms.gradients`."""

from lightning_hooks.core.alarms.gradients import HostSegments

__all__ = ["HostSegments"]
