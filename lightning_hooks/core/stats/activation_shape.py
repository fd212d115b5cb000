"""How heavy the tails of each layer's output are: its kurtosis and its outlier ratio."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from typing_extensions import Unpack

from lightning_hooks.core.kernels.tensors import iter_float_tensors
from lightning_hooks.core.stats.activation_stats import default_feature_module
from lightning_hooks.core.stats.stat import LayerStat, SelectionArgs, selection_of

__all__ = ["ActivationShape"]

Shape = tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]
"""Rows, elements seen, kurtosis and outlier ratio."""


class ActivationShape(LayerStat[Shape]):
    """Per layer, over its outputs in sampled training forwards, ``activations/kurtosis/{layer}``
    (Pearson's, 3 for a Gaussian) and ``activations/outlier_ratio/{layer}`` (``max |x|`` over the
    root mean square). Float64 power sums: they pool exactly over steps and ranks.

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
        assert self.selection is not None
        where = default_feature_module if self.selection.types is None else None
        return self.selection.modules(model, where=where)

    def observe(self, name: str, module: nn.Module, output: Any) -> None:
        """Add the power sums and the peak of every floating tensor of ``output`` to its row."""
        for suffix, tensor in iter_float_tensors(output):
            if tensor.numel():
                self._observe(self.row(name + suffix), tensor.detach())

    def _observe(self, row: int, x: torch.Tensor) -> None:
        d = x.reshape(-1).double()
        square = d * d
        n = torch.full((), d.numel(), dtype=d.dtype, device=d.device)
        self.sums[row] += torch.stack(
            [n, d.sum(), square.sum(), (square * d).sum(), square.square().sum()]
        )
        torch.maximum(self.peak[row], x.abs().amax().float(), out=self.peak[row])

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
        seen = [i for i in range(len(layers)) if n[i] > 0]
        return {
            **{f"activations/kurtosis/{layers[i]}": float(kurtosis[i]) for i in seen},
            **{f"activations/outlier_ratio/{layers[i]}": float(ratio[i]) for i in seen},
        }
