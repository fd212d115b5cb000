"""Dead units: which units of a layer never fired on any training sample, kept on the device.

When a unit *fires*, per watched module (``y`` is the module's output, ``x`` its input):

===================================  =========================  ================================
module                               fired                      read as
===================================  =========================  ================================
``ReLU`` (in-place too), ``ReLU6``   ``x > 0``                  ``y > 0`` (``y == 0`` otherwise)
``LeakyReLU`` (slope >= 0)           ``x > 0``                  ``y > 0``
``ELU``                              ``x > 0``                  ``y > 0`` (``y`` in (-alpha, 0])
``GELU`` (exact and tanh)            ``x > 0``                  ``y > 0`` (``x * Phi(x) > 0``)
``SiLU``                             ``x > 0``                  ``y > 0`` (``x * sigmoid(x)``)
a producing layer (``F.relu`` next)  pre-activation ``y > 0``   ``y > 0``
===================================  =========================  ================================

Every listed activation keeps the sign of its input, so "fired" is the same test on the output,
which is what a forward hook can read (an in-place ReLU has overwritten its input). A functional
``F.relu`` inside ``forward`` cannot be hooked: watch the layer that produces its input instead
(a pre-activation ``<= 0`` never fires).

A *unit* is a channel of a ``[N, C, ...]`` output (convolutions, dim 1) or a feature of a
``[N, ..., F]`` output (linear layers, last dim); see :func:`unit_dim`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.conv import _ConvNd

from lightning_hooks.core.collectives import reduce_across_ranks
from lightning_hooks.core.registry import HookOwner, HookRegistry
from lightning_hooks.core.selection import Patterns, as_patterns, select_modules
from lightning_hooks.core.tensors import is_training_forward, iter_float_tensors

__all__ = ["RELU_FAMILY", "DeadUnitTracker", "DeadUnits", "fired_counts", "unit_dim"]

RELU_FAMILY: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.ELU,
    nn.GELU,
    nn.SiLU,
)
"""Activation module types watched by default."""


def unit_dim(module: nn.Module, ndim: int) -> int:
    """The dimension of a module's ``ndim``-d output that indexes its units.

    Convolutions and batch norms: dim 1 (channels). Linear layers: the last dim. Other modules
    (activations) by rank: 2-d ``[N, F]`` and 3-d ``[N, T, F]`` (sequences) use the last dim,
    4-d and 5-d ``[N, C, H, W(, D)]`` use dim 1. For a ``Conv1d`` followed by an activation, watch
    the convolution (``pre_activation``) to get channels.

    Example:
        >>> unit_dim(nn.Conv1d(2, 3, 1), 3), unit_dim(nn.ReLU(), 3), unit_dim(nn.ReLU(), 4)
        (1, 2, 1)
    """
    if isinstance(module, _ConvNd | _BatchNorm) and ndim >= 2:
        return 1
    if isinstance(module, nn.Linear) or ndim <= 3:
        return ndim - 1
    return 1


@torch.no_grad()
def fired_counts(y: torch.Tensor, dim: int) -> torch.Tensor:
    """``[units]`` integers: how many entries of each unit of ``y`` are ``> 0`` (fired).

    Example:
        >>> fired_counts(torch.tensor([[1.0, 0.0, -2.0], [3.0, 0.0, 0.5]]), dim=1).tolist()
        [2, 0, 1]
    """
    positive = (y.detach() > 0).view(torch.uint8)  # byte sums vectorize, bool sums do not
    others = [d for d in range(y.ndim) if d != dim]
    count = torch.int32 if y.numel() < 2**31 else torch.int64
    return positive.sum(dim=others, dtype=count) if others else positive.to(count)


@dataclass(frozen=True)
class DeadUnits:
    """Host-side result of an epoch, one entry per watched layer that ran.

    Attributes:
        layers: the layers' qualified names.
        units: number of units of each layer.
        dead: number of units that never fired.
        zero_fraction: fraction of the outputs that did not fire, per call, averaged over calls
            (for ``ReLU`` / ``ReLU6``: the fraction of exact zeros).
        calls: number of training forwards observed.
        dead_units: the dead units' indices, per layer.
    """

    layers: tuple[str, ...]
    units: np.ndarray
    dead: np.ndarray
    zero_fraction: np.ndarray
    calls: np.ndarray
    dead_units: tuple[np.ndarray, ...]

    @property
    def dead_fraction(self) -> np.ndarray:
        """``dead / units`` per layer."""
        with np.errstate(divide="ignore", invalid="ignore"):
            fraction: np.ndarray = self.dead / self.units
        return fraction


class DeadUnitTracker(HookOwner):
    """Per-unit "ever fired" counts of activation outputs over an epoch, on the device.

    A forward hook on each watched module counts, per unit, the outputs that fired (see the
    module docstring) in training forwards only, and the fraction of outputs that did not fire.
    A unit is dead if it never fired on any training sample of the period (the definition of the
    keras-contrib ``DeadReluDetector``). A module called twice in a forward is observed twice.

    Args:
        model: the model to watch.
        types: activation module types to watch (default :data:`RELU_FAMILY`).
        include: glob patterns on module names to keep (among ``types``).
        exclude: glob patterns on module names to drop.
        pre_activation: glob patterns of modules whose output feeds a functional activation
            (``F.relu`` in ``forward``); their output ``> 0`` fires. Any module type.

    Example:
        >>> layer = nn.Linear(3, 4)
        >>> with torch.no_grad():
        ...     _ = layer.bias.copy_(torch.tensor([-100.0, -100.0, 0.0, 0.0]))
        >>> model = nn.Sequential(layer, nn.ReLU())
        >>> with DeadUnitTracker(model) as tracker:
        ...     _ = model(torch.randn(32, 3))
        ...     result = tracker.result()
        >>> result.layers, result.dead.tolist(), result.units.tolist()
        (('1',), [2], [4])
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        types: type[nn.Module] | tuple[type[nn.Module], ...] = RELU_FAMILY,
        include: Patterns = None,
        exclude: Patterns = None,
        pre_activation: Patterns = None,
    ) -> None:
        self.registry = HookRegistry(model)
        watched = self.registry.modules(types=types, include=include, exclude=exclude)
        producers = as_patterns(pre_activation, "pre_activation")
        if producers:
            named = dict(watched)
            named.update(select_modules(model, include=producers))
            watched = [(n, m) for n, m in model.named_modules() if n in named]
        if not watched:
            raise ValueError(
                f"DeadUnitTracker: no module to watch (types={types!r}, include={include!r}, "
                f"exclude={exclude!r}, pre_activation={pre_activation!r})"
            )
        self.layers = tuple(name for name, _ in watched)
        self._counts: list[torch.Tensor | None] = [None] * len(self.layers)
        self._fired: torch.Tensor | None = None  # per row: sum over calls of the fired fraction
        self._calls = [0] * len(self.layers)
        for row, (_, module) in enumerate(watched):
            self.registry.forward_hook(module, self._hook(row), gated=True)

    def _hook(self, row: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not is_training_forward(module):
                return
            tensor = next((t for _, t in iter_float_tensors(output) if t.ndim >= 1), None)
            if tensor is not None and tensor.numel() > 0:
                self._observe(row, tensor, unit_dim(module, tensor.ndim))

        return hook

    @torch.no_grad()
    def _observe(self, row: int, y: torch.Tensor, dim: int) -> None:
        counts = fired_counts(y, dim)
        if self._fired is None:
            self._fired = torch.zeros(len(self.layers), device=y.device, dtype=_dtype(y.device))
        total = self._counts[row]
        if total is None or total.numel() != counts.numel():
            total = self._counts[row] = torch.zeros_like(counts, dtype=self._fired.dtype)
        total.add_(counts)
        self._fired.select(0, row).add_(counts.sum(), alpha=1.0 / y.numel())
        self._calls[row] += 1

    def result(self) -> DeadUnits:
        """Dead units so far (summed across ranks), copied to the host once."""
        seen = [i for i, c in enumerate(self._counts) if c is not None]
        if self._fired is None or not seen:
            empty = np.zeros(0)
            return DeadUnits((), empty, empty, empty, empty, ())
        calls = torch.tensor(self._calls, dtype=self._fired.dtype).to(self._fired.device)
        parts = [self._fired, calls, *(c for c in self._counts if c is not None)]
        host = reduce_across_ranks(torch.cat(parts), "sum").cpu().numpy()
        rows = len(self.layers)
        fired, calls_np, offset = host[:rows], host[rows : 2 * rows], 2 * rows
        per_unit = []
        for i in seen:
            size = self._counts[i].numel()  # type: ignore[union-attr]
            per_unit.append(host[offset : offset + size])
            offset += size
        return DeadUnits(
            layers=tuple(self.layers[i] for i in seen),
            units=np.array([u.size for u in per_unit], dtype=np.int64),
            dead=np.array([int((u == 0).sum()) for u in per_unit], dtype=np.int64),
            zero_fraction=1.0 - fired[seen] / calls_np[seen],
            calls=calls_np[seen],
            dead_units=tuple(np.flatnonzero(u == 0) for u in per_unit),
        )

    def reset(self) -> None:
        """Start a new period (an epoch): every unit is dead again until it fires."""
        for counts in self._counts:
            if counts is not None:
                counts.zero_()
        if self._fired is not None:
            self._fired.zero_()
        self._calls = [0] * len(self.layers)


def _dtype(device: torch.device) -> torch.dtype:
    return torch.float32 if device.type == "mps" else torch.float64
