"""Saturation of bounded activations (Sigmoid, Tanh, Hardtanh, ...)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.selection import ModuleTypes, Patterns, Selection, torch_equivalent
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.tags import SATURATION, layer_tag

__all__ = [
    "SATURATING_TYPES",
    "SaturatedUnits",
    "SaturationTracker",
    "saturation_mask",
    "unit_saturation",
]

# ReLU6 too: a Hardtanh(0, 6)
SATURATING_TYPES: tuple[type[nn.Module], ...] = (
    nn.Sigmoid,
    nn.Tanh,
    nn.Softsign,
    nn.Hardtanh,
    nn.Hardsigmoid,
)


def saturation_mask(module: nn.Module, output: torch.Tensor, margin: float = 0.01) -> torch.Tensor:
    """Return which entries of a bounded activation's output are saturated, as a boolean tensor.

    * ``Sigmoid``: ``out < margin`` or ``out > 1 - margin``;
    * ``Tanh``, ``Softsign``: ``|out| > 1 - margin`` (under 2% of the gradient passes back);
    * ``Hardtanh`` (``ReLU6`` too): ``out <= min_val`` or ``out >= max_val`` (zero gradient);
    * ``Hardsigmoid``: ``out <= 0`` or ``out >= 1`` (zero gradient).

    Args:
        module: the activation, whose type and bounds set the test.
        output: the activation's output.
        margin: the threshold margin of the smooth activations.

    Returns:
        The boolean mask, ``output``'s shape.

    Raises:
        TypeError: ``module`` is none of the types above.

    Example:
        >>> saturation_mask(nn.Tanh(), torch.tensor([0.0, 0.995, -0.999])).tolist()
        [False, True, True]
        >>> saturation_mask(nn.ReLU6(), torch.tensor([0.0, 3.0, 6.0])).tolist()
        [True, False, True]
    """
    kind = torch_equivalent(module)  # timm's Tanh, Hugging Face's LaplaceActivation, ...
    if issubclass(kind, nn.Sigmoid):
        return (output < margin) | (output > 1 - margin)
    if issubclass(kind, nn.Tanh | nn.Softsign):
        return output.abs() > 1 - margin
    if isinstance(module, nn.Hardtanh):
        return (output <= module.min_val) | (output >= module.max_val)
    if issubclass(kind, nn.Hardsigmoid):
        return (output <= 0) | (output >= 1)
    raise TypeError(
        f"saturation_mask(module=...): expected one of "
        f"{[t.__name__ for t in SATURATING_TYPES]}, got {type(module).__name__}"
    )


def unit_saturation(mask: torch.Tensor, unit_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Count the saturated entries of ``mask`` and find the units with an unsaturated one.

    Args:
        mask: which entries are saturated (:func:`saturation_mask`).
        unit_dim: the dimension that indexes units (out of range: one unit).

    Returns:
        ``(count, unsaturated)``: an int64 count of saturated entries and a ``[units]`` boolean,
        which units had an unsaturated entry.

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
    # amin over the mask's bytes: faster on the CPU than all(dim=...), and no copy
    return count, mask.view(torch.uint8).amin(dim=dims) == 0


@dataclass(frozen=True)
class SaturatedUnits:
    """What :class:`SaturationTracker` found over a period (its result), one row per layer.

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
        return np.where(self.entries > 0, self.saturated / np.maximum(self.entries, 1), np.nan)

    @property
    def always_saturated_fraction(self) -> np.ndarray:
        """Always-saturated units over units (``NaN`` for a layer that never ran)."""
        return np.where(self.entries > 0, self.always_saturated / np.maximum(self.units, 1), np.nan)


@named_arguments
class SaturationTracker(LayerStat[SaturatedUnits]):
    """Counts per layer the saturated outputs of training forwards and the units never unsaturated.

    Saturation is :func:`saturation_mask`'s; no host sync.

    Args:
        model: the model to watch now (``None``: call :meth:`attach` later).
        types: the module types to watch (``None``: :data:`SATURATING_TYPES`).
        include: glob patterns on qualified module names to keep (``None``: every name).
        exclude: glob patterns on qualified module names to drop.
        unit_dim: the output dimension that indexes units.
        margin: the threshold margin of the smooth activations (see :func:`saturation_mask`).
        owner: the public name errors give.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.Tanh())
        >>> tracker = SaturationTracker(model)
        >>> with torch.no_grad():
        ...     _ = model[0].weight.copy_(torch.tensor([[9.0, 9.0], [0.0, 0.0], [9.0, 0.0]]))
        ...     _ = model[0].bias.zero_()
        >>> _ = model(torch.tensor([[1.0, 1.0], [1.0, -1.0]]))
        >>> stats = tracker.result()
        >>> stats.saturated.tolist(), stats.always_saturated.tolist(), stats.units.tolist()
        ([3], [1], [3])
        >>> tracker.remove()
    """

    saturated: torch.Tensor
    entries: torch.Tensor
    unsaturated: torch.Tensor

    def __init__(  # noqa: PLR0913 (a public constructor: one keyword per option)
        self,
        model: nn.Module | None = None,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        unit_dim: int = 1,
        margin: float = 0.01,
        owner: str = "SaturationTracker",
    ) -> None:
        watched = types or SATURATING_TYPES
        super().__init__(Selection.of(owner, types=watched, include=include, exclude=exclude))
        self.owner = owner
        self.unit_dim = unit_dim
        self.margin = margin
        self.add_layer_state("saturated", reduce="sum", dtype=torch.int64)
        self.add_layer_state("entries", reduce="sum", dtype=torch.int64)
        self.add_layer_state("unsaturated", reduce="max", dtype=torch.bool, kind="unit")
        if model is not None:
            self.attach(model)

    def observe(self, name: str, module: nn.Module, output: object) -> None:
        """Count the saturated entries of ``output`` and mark its units ever unsaturated.

        Args:
            name: the activation's qualified name, its row's name.
            module: the activation, whose type and bounds set the test.
            output: what the activation returned; anything but a tensor is skipped.

        Raises:
            ValueError: the layer's number of units along ``unit_dim`` changed.
        """
        if not isinstance(output, torch.Tensor):
            return
        count, unsaturated = unit_saturation(
            saturation_mask(module, output.detach(), self.margin), self.unit_dim
        )
        known = self.rows.get(name)
        if known is not None and self.units[known] != unsaturated.numel():
            raise ValueError(
                f"{self.owner}(unit_dim={self.unit_dim}): layer {name!r} had "
                f"{self.units[known]} units, now {unsaturated.numel()} (output shape "
                f"{tuple(output.shape)}); pass the unit_dim whose size does not change"
            )
        row = self.row(name, unsaturated.numel())
        self.saturated[row].add_(count)
        self.unsaturated[self.unit_slice(row)].logical_or_(unsaturated)
        self.tally("entries", row, output.numel())

    def summarize(self, states: dict[str, np.ndarray]) -> SaturatedUnits:
        """Turn the reduced host states into the period's result.

        Args:
            states: the ``saturated``, ``entries`` and ``unsaturated`` states, reduced across
                ranks.

        Returns:
            The saturated entries and always-saturated units of each layer.
        """
        flags = states["unsaturated"]
        always = [int((flags[self.unit_slice(i)] == 0).sum()) for i in range(len(self.rows))]
        return SaturatedUnits(
            self.layers,
            states["entries"].astype(np.int64),
            states["saturated"].astype(np.int64),
            np.array(self.units, dtype=np.int64),
            np.array(always, dtype=np.int64),
        )

    def step_values(self, result: SaturatedUnits) -> dict[str, float]:
        """Return the saturated fractions only, at a logging step.

        Args:
            result: the logging step's result.

        Returns:
            The scalars by tag; nothing when no layer ran.
        """
        if not (result.entries > 0).any():
            return {}
        return {k: v for k, v in self.tags(result).items() if "always_saturated" not in k}

    def tags(self, result: SaturatedUnits) -> dict[str, float]:
        """Return the saturated and always-saturated fractions and the layers that ran.

        The fractions are per layer and global.

        Args:
            result: the period's result.

        Returns:
            The scalars, by tag.
        """
        out: dict[str, float] = {}
        ran = result.entries > 0
        saturated = result.saturated_fraction
        always = result.always_saturated_fraction
        for i in np.flatnonzero(ran):
            layer = result.layers[i]
            out[layer_tag(SATURATION, "saturated_fraction", layer)] = float(saturated[i])
            out[layer_tag(SATURATION, "always_saturated_fraction", layer)] = float(always[i])
        if ran.any():
            total = result.saturated[ran].sum() / result.entries[ran].sum()
            out[layer_tag(SATURATION, "saturated_fraction")] = float(total)
            always_all = result.always_saturated[ran].sum() / result.units[ran].sum()
            out[layer_tag(SATURATION, "always_saturated_fraction")] = float(always_all)
        out[layer_tag(SATURATION, "layers")] = float(ran.sum())
        return out


SaturationStats = SaturatedUnits
"""0.2.0's name of :class:`SaturatedUnits`: a result, which the name of a statistic misread."""
