"""How heavy the tails of each layer's output are: its kurtosis and its outlier ratio."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from lightning_hooks import internals
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.selection import ModuleTypes, Patterns, Selection
from lightning_hooks.core.ops.feature_stats import CHUNK, STACKED
from lightning_hooks.core.ops.tensors import iter_float_tensors, piece_size
from lightning_hooks.core.stats.activation_stats import feature_modules
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.tags import ACTIVATIONS, layer_tag

__all__ = ["ActivationShape", "power_sums"]

Shape = tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]
"""Rows, elements seen, kurtosis and outlier ratio."""


_BINOMIAL = torch.tensor(  # C(i, j); 0 for j > i
    [[math.comb(i, j) for j in range(5)] for i in range(5)], dtype=torch.float64
)
_POWER = (torch.arange(5)[:, None] - torch.arange(5)).clamp(min=0)  # [i, j]: i - j, or 0
_EXPONENTS = torch.arange(5, dtype=torch.float64)


def power_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the power sums and the peak of each row of a ``[k, n]`` tensor.

    Why float32 is exact here: the powers summed are of ``y = (x - m) / s``, ``m`` the row's
    mean and ``s`` its largest ``|x - m|``. Every term lies in ``[-1, 1]``: nothing overflows, and
    only terms ``2^-126`` below the largest underflow. The two sums kurtosis is made of (``y^2``,
    ``y^4``) have terms of one sign, so torch's blocked float32 sum keeps each within about
    ``1e-6`` relative of the float64 one, outputs with a few entries ``1e4`` times their RMS
    included; the errors of the signed sums (``y``, ``y^3``) cancel in the central moments. The
    sums about 0 are rebuilt from these in float64 (binomially, about ``m``), and lose to
    cancellation what float64 sums of ``x^k`` would. Float32 halves the bytes read and written
    against float64, and no copy of the output is made in float64.

    Args:
        x: the ``[k, n]`` tensor, one output per row.

    Returns:
        ``[k, 5]`` float64 ``n`` and the sums of ``x``, ``x^2``, ``x^3`` and ``x^4``, and ``[k]``
        float32 ``max |x|``.

    Example:
        >>> sums, peak = power_sums(torch.tensor([[1.0, 2.0], [-1.0, 0.0]]))
        >>> sums.tolist(), peak.tolist()
        ([[2.0, 3.0, 5.0, 9.0, 17.0], [2.0, -1.0, 1.0, -1.0, 1.0]], [2.0, 1.0])
    """
    f = x.to(torch.promote_types(x.dtype, torch.float32))
    # aminmax: slower on the CPU
    low = f.amin(1, keepdim=True)
    high = f.amax(1, keepdim=True)
    mean = f.mean(1, keepdim=True)
    scale = torch.maximum(high - mean, mean - low).clamp_(min=torch.finfo(f.dtype).tiny)
    y = (f - mean).div_(scale)
    square = y * y
    # the odd powers and the fourth are made in place: two temporaries of x's size, not four
    sums = [y.sum(1), square.sum(1), y.mul_(square).sum(1), square.mul_(square).sum(1)]
    central = torch.stack([torch.ones_like(sums[0]), *sums], dim=1).double()  # about m, / s^j
    exponents = _EXPONENTS.to(x.device)
    central *= scale.double() ** exponents
    central[:, 0] = f.shape[1]
    # sum of x^i = sum over j of C(i, j) m^(i - j) (sum of (x - m)^j)
    shift = mean.double() ** exponents
    binomial = _BINOMIAL.to(x.device) * shift[:, _POWER.to(x.device)]
    return (binomial * central[:, None, :]).sum(2), torch.maximum(high, -low).view(-1).float()


@named_arguments
class ActivationShape(LayerStat[Shape]):
    """Measures per layer, over its outputs at logging steps, the kurtosis and the outlier ratio.

    It logs ``activations/kurtosis/{layer}`` (Pearson's, 3 for a Gaussian) and
    ``activations/outlier_ratio/{layer}`` (``max |x|`` over the RMS), from power sums
    (:func:`power_sums`); small outputs are measured a batch per shape at the step's end, large
    ones a piece at a time.

    Args:
        types: only modules of these types (``None``: :func:`.default_feature_module`'s).
        include: glob patterns on qualified module names to keep (``None``: every name).
        exclude: glob patterns on qualified module names to drop.
        owner: the name the selection's errors begin with.

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
        self,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        owner: str = "ActivationShape",
    ) -> None:
        super().__init__(Selection.of(owner, types=types, include=include, exclude=exclude))
        self.add_layer_state("sums", reduce="sum", width=(5,))  # n, sums of x, x^2, x^3, x^4
        self.add_layer_state("peak", reduce="max", dtype=torch.float32)  # max |x|

    def select(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Return the activation statistics' modules (default: parameter owners and activations).

        Args:
            model: the model the modules are selected from.

        Returns:
            ``(name, module)`` of each module to hook.
        """
        return feature_modules(self.selection, model)

    def observe(self, name: str, module: nn.Module, output: object) -> None:
        """Add the power sums and the peak of every floating tensor of ``output`` to its row.

        Args:
            name: the module's qualified name, which a tensor's suffix extends into its row's name.
            module: the module that ran.
            output: what the module returned.
        """
        if type(output) is torch.Tensor:  # most modules': no walk of the output
            if output.is_floating_point():
                self._observe_one(name, output)
            return
        for suffix, tensor in iter_float_tensors(output):
            self._observe_one(name + suffix, tensor)

    def _observe_one(self, name: str, x: torch.Tensor) -> None:
        """Add one tensor's power sums and peak to row ``name``, a small one at :meth:`drain`."""
        row = self.rows.get(name)
        row = self.row(name) if row is None else row  # an empty output's row too
        n = x.numel()
        if 0 < n <= STACKED and not internals.is_compiling():
            self._defer((x.shape, x.dtype, x.device), row, self._snapshot(x))
            return
        # A large output a piece at a time, each about its own mean and scale: the temporaries
        # stay in cache on the CPU, and the pieces pool exactly as the calls of a layer do.
        flat = x.detach().reshape(-1)
        chunk = piece_size(flat.device, CHUNK)
        for start in range(0, n, chunk):
            self._add([row], flat[start : start + chunk][None])

    def drain(self) -> None:
        """Measure the small outputs copied since the last call, a batch per shape."""
        for _, rows, copies in self._drain_pending():
            self._add(rows, copies)
        super().drain()

    def _add(self, rows: list[int], x: torch.Tensor) -> None:
        """Add the power sums and the peaks of the ``len(rows)`` tensors stacked in ``x``."""
        index = self._pending.index(rows, x.device)
        sums, peak = power_sums(x.reshape(len(x), -1))
        self.sums.index_add_(0, index, sums)
        self.peak.scatter_reduce_(0, index, peak, "amax")

    def summarize(self, states: dict[str, np.ndarray]) -> Shape:
        """Compute the kurtosis and the outlier ratio from the pooled power sums.

        Args:
            states: the ``sums`` and ``peak`` states, reduced across ranks.

        Returns:
            The kurtosis and the outlier ratio of each layer.
        """
        n, s1, s2, s3, s4 = states["sums"].T
        with np.errstate(divide="ignore", invalid="ignore"):
            mu = s1 / n
            m2 = s2 / n
            m3 = s3 / n
            m4 = s4 / n
            variance = m2 - mu * mu
            central4 = m4 - 4 * mu * m3 + 6 * mu * mu * m2 - 3 * mu**4
            kurtosis = central4 / variance**2
            ratio = states["peak"].astype(np.float64) / np.sqrt(m2)
        return self.layers, n, kurtosis, ratio

    def tags(self, result: Shape) -> dict[str, float]:
        """Return ``activations/kurtosis/{layer}`` and ``activations/outlier_ratio/{layer}``.

        Args:
            result: what :meth:`summarize` returned.

        Returns:
            The scalars, by tag.
        """
        layers, n, kurtosis, ratio = result
        pairs = (("kurtosis", kurtosis), ("outlier_ratio", ratio))
        seen = [i for i in range(len(layers)) if n[i] > 0]
        return {layer_tag(ACTIVATIONS, s, layers[i]): float(v[i]) for s, v in pairs for i in seen}
