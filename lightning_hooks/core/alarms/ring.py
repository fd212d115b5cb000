"""The device ring buffer of the last steps' norms, running scales and spike bands, that an
alarm's diagnosis reads on the host."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["NormRing"]


class NormRing:
    """The last ``size`` steps' ``[3, rows]`` (norm, running scale, half-width of the spike
    band in log) of every row, on the device, and their steps on the host.

    Args:
        size: steps kept.
        rows: the layers and the global row.
        device: where the buffer lives.
    """

    def __init__(self, size: int, rows: int, device: torch.device) -> None:
        self.ring = torch.full((size, 3, rows), torch.nan, device=device)
        self.steps = [-1] * size

    def write(self, step: int, rows: torch.Tensor) -> None:
        """Keep ``rows`` (``[3, rows]``) as ``step``'s (a copy on the device, no sync)."""
        slot = step % len(self.steps)
        self.ring[slot].copy_(rows)
        self.steps[slot] = step

    def read(self, step: int) -> tuple[list[int], np.ndarray]:
        """The buffer up to ``step``, oldest first, on the host (a sync: an alarm fired)."""
        ring = self.ring.cpu().numpy()
        slots = sorted(
            (s, i) for i, s in enumerate(self.steps) if 0 <= s <= step and step - s < len(ring)
        )
        return [s for s, _ in slots], ring[[i for _, i in slots]]

    def state_dict(self) -> dict[str, Any]:
        """The buffer and its steps, on the host."""
        return {"ring": self.ring.cpu(), "ring_steps": list(self.steps)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` when its size is this buffer's (else it starts empty)."""
        if state["ring"].shape == self.ring.shape:
            self.ring.copy_(state["ring"])
            self.steps = list(state["ring_steps"])
