"""Saturation of bounded activations (Sigmoid, Tanh, Hardtanh, ...), measured on the device."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_hooks.core.registry import HookOwner, HookRegistry
from lightning_hooks.core.selection import ModuleTypes, Patterns
from lightning_hooks.core.tensors import is_training_forward

__all__ = [
    "SATURATING_TYPES",
    "SaturationStats",
    "SaturationTracker",
    "saturation_mask",
    "unit_saturation",
]

SATURATING_TYPES: tuple[type[nn.Module], ...] = (
    nn.Sigmoid,
    nn.Tanh,
    nn.Softsign,
    nn.Hardtanh,  # ReLU6 too: a Hardtanh(0, 6)
    nn.Hardsigmoid,
)


def saturation_mask(module: nn.Module, output: torch.Tensor, margin: float = 0.01) -> torch.Tensor:
    """Which entries of a bounded activation's output are saturated, as a boolean tensor.

    ==================  ====================================================  ==================
    Module              saturated when                                        default
    ==================  ====================================================  ==================
    ``Sigmoid``         ``out < margin`` or ``out > 1 - margin``              ``< 0.01, > 0.99``
    ``Tanh``            ``|out| > 1 - margin``                                ``|out| > 0.99``
    ``Softsign``        ``|out| > 1 - margin``                                ``|out| > 0.99``
    ``Hardtanh``        ``out <= min_val`` or ``out >= max_val`` (exactly:    ``-1``, ``1``
                        the gradient is zero there; ``ReLU6``: 0 and 6)
    ``Hardsigmoid``     ``out <= 0`` or ``out >= 1`` (zero gradient)          ``0``, ``1``
    ==================  ====================================================  ==================

    A smooth unit with ``|tanh| > 0.99`` passes back less than 2% of the gradient
    (``1 - 0.99**2``); a sigmoid at 0.01 or 0.99 about 4% of its peak gradient.

    Raises:
        TypeError: ``module`` is none of the types above.

    Example:
        >>> saturation_mask(nn.Tanh(), torch.tensor([0.0, 0.995, -0.999])).tolist()
        [False, True, True]
        >>> saturation_mask(nn.ReLU6(), torch.tensor([0.0, 3.0, 6.0])).tolist()
        [True, False, True]
    """
    if isinstance(module, nn.Sigmoid):
        return (output < margin) | (output > 1 - margin)
    if isinstance(module, nn.Tanh | nn.Softsign):
        return output.abs() > 1 - margin
    if isinstance(module, nn.Hardtanh):
        return (output <= module.min_val) | (output >= module.max_val)
    if isinstance(module, nn.Hardsigmoid):
        return (output <= 0) | (output >= 1)
    raise TypeError(
        f"saturation_mask(module=...): expected one of "
        f"{[t.__name__ for t in SATURATING_TYPES]}, got {type(module).__name__}"
    )


def unit_saturation(mask: torch.Tensor, unit_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Saturated entries, and which units had any unsaturated entry, on the device.

    A *unit* is an index along ``unit_dim`` (a feature of a ``Linear``, a channel of a conv;
    negative counts from the end); its entries are every sample and position. A tensor with no
    ``unit_dim`` is one unit.

    Returns:
        ``(count, unsaturated)``: the number of saturated entries (an int64 scalar tensor) and a
        ``[units]`` boolean tensor, true for each unit with at least one unsaturated entry.

    Example:
        >>> mask = torch.tensor([[True, False], [True, True]])  # 2 samples, 2 units
        >>> count, unsaturated = unit_saturation(mask)
        >>> int(count), unsaturated.tolist()
        (3, [False, True])
    """
    count = torch.count_nonzero(mask)
    if not -mask.dim() <= unit_dim < mask.dim():
        return count, ~mask.all().reshape(1)
    unit_dim %= mask.dim()
    dims = tuple(d for d in range(mask.dim()) if d != unit_dim)
    if not dims:
        return count, ~mask
    # amin over the mask's bytes is ~10x faster on the CPU than all(dim=...), and no copy
    return count, mask.view(torch.uint8).amin(dim=dims) == 0


@dataclass(frozen=True)
class SaturationStats:
    """Host-side saturation over a period, one row per layer.

    Attributes:
        layers: layer names.
        entries: output entries observed per layer (0: the layer never ran).
        saturated: saturated entries per layer.
        units: units per layer.
        always_saturated: units with no unsaturated entry in the period, per layer.
    """

    layers: tuple[str, ...]
    entries: np.ndarray
    saturated: np.ndarray
    units: np.ndarray
    always_saturated: np.ndarray

    @property
    def saturated_fraction(self) -> np.ndarray:
        """Saturated entries over entries (``NaN`` for a layer that never ran)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.entries > 0, self.saturated / self.entries, np.nan)

    @property
    def always_saturated_fraction(self) -> np.ndarray:
        """Always-saturated units over units (``NaN`` for a layer that never ran)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.entries > 0, self.always_saturated / self.units, np.nan)


class SaturationTracker(HookOwner):
    """Counts saturated outputs of bounded activations over training forwards, on the device.

    A forward hook on each selected module computes :func:`saturation_mask` and
    :func:`unit_saturation` and adds them in place to device tensors: one int64 count per layer
    and one "ever unsaturated" boolean per unit. No host sync. Only training forwards count.
    :meth:`packed` gives every state as one int64 tensor (to all-reduce with a sum: a unit is
    ever unsaturated when its sum is positive), :meth:`unpack` turns it into
    :class:`SaturationStats`.

    Args:
        model: the model.
        types: the module types to watch (default :data:`SATURATING_TYPES`; each must be one of
            them or a subclass).
        include: glob patterns on qualified names to keep.
        exclude: glob patterns on qualified names to drop.
        unit_dim: the output dimension that indexes units.
        margin: the threshold margin of the smooth activations (see :func:`saturation_mask`).

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.Tanh())
        >>> tracker = SaturationTracker(model)
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.tensor([[9.0, 9.0], [0.0, 0.0], [9.0, 0.0]]))
        ...     _ = model[0].bias.zero_()
        >>> _ = model(torch.tensor([[1.0, 1.0], [1.0, -1.0]]))
        >>> stats = tracker.unpack(tracker.packed())
        >>> stats.saturated.tolist(), stats.always_saturated.tolist(), stats.units.tolist()
        ([3], [1], [3])
        >>> tracker.remove()
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        unit_dim: int = 1,
        margin: float = 0.01,
    ) -> None:
        self.unit_dim = unit_dim
        self.margin = margin
        self.registry = HookRegistry(model)
        selected = self.registry.modules(
            types=types or SATURATING_TYPES, include=include, exclude=exclude
        )
        self.layers = tuple(name for name, _ in selected)
        device = next(model.parameters(), torch.empty(0)).device
        self._saturated = torch.zeros(len(self.layers), dtype=torch.int64, device=device)
        self._entries = [0] * len(self.layers)
        self._unsaturated: list[torch.Tensor | None] = [None] * len(self.layers)
        for index, (_, module) in enumerate(selected):
            self.registry.forward_hook(module, self._hook(index), gated=True)

    def _hook(self, index: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor) and is_training_forward(module):
                self._observe(index, module, output.detach())

        return hook

    def _observe(self, index: int, module: nn.Module, output: torch.Tensor) -> None:
        count, unsaturated = unit_saturation(
            saturation_mask(module, output, self.margin), self.unit_dim
        )
        if self._saturated.device != output.device:
            self._saturated = self._saturated.to(output.device)
        self._saturated[index] += count
        self._entries[index] += output.numel()
        seen = self._unsaturated[index]
        if seen is None:
            self._unsaturated[index] = unsaturated.clone()
        elif seen.shape != unsaturated.shape:
            raise ValueError(
                f"SaturationTracker(unit_dim={self.unit_dim}): layer {self.layers[index]!r} "
                f"had {seen.numel()} units, now {unsaturated.numel()} (output shape "
                f"{tuple(output.shape)}); pass the unit_dim whose size does not change"
            )
        else:
            seen |= unsaturated

    def packed(self) -> torch.Tensor:
        """Every state as one int64 device tensor: saturated, entries, units, per-unit flags."""
        device = self._saturated.device
        units = [0 if u is None else u.numel() for u in self._unsaturated]
        head = torch.tensor([*self._entries, *units], dtype=torch.int64, device=device)
        flags = [u.to(torch.int64) for u in self._unsaturated if u is not None]
        return torch.cat([self._saturated, head, *flags])

    def unpack(self, packed: torch.Tensor) -> SaturationStats:
        """:class:`SaturationStats` from a :meth:`packed` tensor (copied to the host once)."""
        values = packed.cpu().numpy()
        n = len(self.layers)
        saturated, entries, units = values[:n], values[n : 2 * n], values[2 * n : 3 * n]
        bounds = np.cumsum([3 * n, *units])
        always = np.array(
            [int((values[lo:hi] == 0).sum()) for lo, hi in itertools.pairwise(bounds)],
            dtype=np.int64,
        )
        return SaturationStats(self.layers, entries, saturated, units, always)

    def reset(self) -> None:
        """Start a new period (call after reading)."""
        self._saturated.zero_()
        self._entries = [0] * len(self.layers)
        self._unsaturated = [None] * len(self.layers)
