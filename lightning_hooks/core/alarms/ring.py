"""The host ring buffer of the last steps' norms, running scales and spike bands, that an
alarm's diagnosis reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lightning_hooks.core.alarms.scale import as_array

__all__ = ["NormRing"]


class NormRing:
    """The last ``size`` steps' ``[3, rows]`` (norm, running scale, half-width of the spike
    band in log) of every row, and their steps, in host memory.

    Args:
        size: steps kept.
        rows: the layers and the global row.
    """

    def __init__(self, size: int, rows: int) -> None:
        self.ring = np.full((size, 3, rows), np.nan, dtype=np.float32)
        self.steps = [-1] * size

    def write(self, step: int, rows: np.ndarray) -> None:
        """Keep ``rows`` (``[3, rows]``) as ``step``'s."""
        slot = step % len(self.steps)
        self.ring[slot] = rows
        self.steps[slot] = step

    def read(self, step: int) -> tuple[list[int], np.ndarray]:
        """The buffer up to ``step``, oldest first."""
        ring = self.ring
        slots = sorted(
            (s, i) for i, s in enumerate(self.steps) if 0 <= s <= step and step - s < len(ring)
        )
        return [s for s, _ in slots], ring[[i for _, i in slots]]

    def state_dict(self) -> dict[str, Any]:
        """The buffer and its steps."""
        return {"ring": torch.from_numpy(self.ring.copy()), "ring_steps": list(self.steps)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` when its size is this buffer's (else it starts empty)."""
        if tuple(state["ring"].shape) == self.ring.shape:
            self.ring[...] = as_array(state["ring"])
            self.steps = list(state["ring_steps"])
