"""How heavy the tails of each layer's output are: its kurtosis and its outlier ratio."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from typing_extensions import Unpack

from lightning_hooks.core.ops.feature_stats import STACKED
from lightning_hooks.core.ops.tensors import iter_float_tensors
from lightning_hooks.core.stats.activation_stats import feature_modules
from lightning_hooks.core.stats.stat import LayerStat, SelectionArgs, selection_of

__all__ = ["ActivationShape"]

Shape = tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]
"""Rows, elements seen, kurtosis and outlier ratio."""


class ActivationShape(LayerStat[Shape]):
    """Per layer, over its outputs at logging steps, ``activations/kurtosis/{layer}``
    (Pearson's, 3 for a Gaussian) and ``activations/outlier_ratio/{layer}`` (``max |x|`` over the
    RMS), from float64 power sums; small outputs are measured a batch per shape at the step's end.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 4), nn.ReLU())
        >>> with ActivationShape().attach(model.train()) as stat:
        ...     _ = model(torch.ones(3, 2))
        ...     sorted(stat.tags(stat.result()))[:2]
        ['activations/kurtosis/0', 'activations/kurtosis/1']
    """

    sums: torch.Tensor
    peak: torch.Tensor

    def __init__(
        self, *, owner: str = "ActivationShape", **selection: Unpack[SelectionArgs]
    ) -> None:
        super().__init__(selection_of(type(self).__name__, owner, selection))
        self.add_layer_state("sums", reduce="sum", width=(5,))  # n, sums of x, x^2, x^3, x^4
        self.add_layer_state("peak", reduce="max", dtype=torch.float32)  # max |x|

    def select(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The activation statistics' modules (default: parameter owners and activations)."""
        return feature_modules(self.selection, model)

    def observe(self, name: str, module: nn.Module, output: object) -> None:
        """Add the power sums and the peak of every floating tensor of ``output`` to its row."""
        for suffix, tensor in iter_float_tensors(output):
            x, row = tensor.detach(), self.row(name + suffix)
            if 0 < x.numel() <= STACKED and not torch.compiler.is_compiling():
                # a copy, before an in-place op overwrites the output
                self._defer((x.shape, x.dtype, x.device), row, x.clone())
            elif x.numel():
                self._add([row], x[None])

    def drain(self) -> None:
        """Measure the small outputs copied since the last call, a batch per shape."""
        for _, rows, copies in self._pending.drain():
            self._add(rows, copies)
        super().drain()

    def _add(self, rows: list[int], x: torch.Tensor) -> None:
        """Add the power sums and the peaks of the ``len(rows)`` tensors stacked in ``x``."""
        index = self._pending.index(rows, x.device)
        d = x.reshape(len(x), -1).double()
        square = d * d
        n = torch.full((len(d),), d.shape[1], dtype=d.dtype, device=d.device)
        sums = [n, d.sum(1), square.sum(1), (square * d).sum(1), square.square().sum(1)]
        self.sums.index_add_(0, index, torch.stack(sums, dim=1))
        self.peak.scatter_reduce_(0, index, d.abs().amax(1).float(), "amax")

    def summarize(self, states: dict[str, np.ndarray]) -> Shape:
        """Kurtosis and outlier ratio from the pooled power sums."""
        n, s1, s2, s3, s4 = states["sums"].T
        with np.errstate(divide="ignore", invalid="ignore"):
            mu, m2, m3, m4 = s1 / n, s2 / n, s3 / n, s4 / n
            variance = m2 - mu * mu
            central4 = m4 - 4 * mu * m3 + 6 * mu * mu * m2 - 3 * mu**4
            kurtosis = central4 / variance**2
            ratio = states["peak"].astype(np.float64) / np.sqrt(m2)
        return self.layers, n, kurtosis, ratio

    def tags(self, result: Shape) -> dict[str, float]:
        """``activations/kurtosis/{layer}`` and ``activations/outlier_ratio/{layer}``."""
        layers, n, kurtosis, ratio = result
        pairs = (("kurtosis", kurtosis), ("outlier_ratio", ratio))
        seen = [i for i in range(len(layers)) if n[i] > 0]
        return {f"activations/{s}/{layers[i]}": float(v[i]) for s, v in pairs for i in seen}
