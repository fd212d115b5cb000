"""Statistics of each layer's output, accumulated over an epoch without a host sync."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from lightning_hooks import internals
from lightning_hooks.core.checks import named_arguments
from lightning_hooks.core.hooks.registry import HookRegistry
from lightning_hooks.core.hooks.selection import ModuleTypes, Patterns, Selection, is_kind
from lightning_hooks.core.host_copy import FirstNonFinite
from lightning_hooks.core.ops.feature_stats import (
    FEATURE_STATS,
    NUM_SUMS,
    STACKED,
    FeatureSummary,
    feature_stats,
    fused_feature_stats,
    stacked_feature_stats,
    summarize,
)
from lightning_hooks.core.ops.histogram import bin_counts, linear_edges
from lightning_hooks.core.ops.tensors import Workspace, iter_float_tensors
from lightning_hooks.core.stats.stat import LayerStat
from lightning_hooks.tags import ACTIVATIONS, layer_tag

__all__ = [
    "ACTIVATION_MODULES",
    "ActivationResult",
    "ActivationStatsTracker",
    "Histogram",
    "default_feature_module",
    "owns_parameters",
]

ACTIVATION_MODULES: tuple[type[nn.Module], ...] = (
    *(nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU),
    *(nn.Mish, nn.Hardswish, nn.Sigmoid, nn.Tanh, nn.Softplus),
)
"""Activation module types the default selection includes (third-party look-alikes too)."""

_NONFINITE = FEATURE_STATS.index("nonfinite")  # its column in the sums
_SIGN = (-1.0, 1.0)  # extremes are kept as (-min, max) so one max-reduce pools both
SCALARS = ("mean", "std", "min", "max", "abs_mean", "zero_fraction", "nonfinite")
"""The statistics logged as ``activations/{stat}/{layer}``."""


def default_feature_module(name: str, module: nn.Module) -> bool:
    """Return whether a module is in the default selection.

    The default selection is modules owning a parameter directly (not a container through its
    children), and activation modules (:data:`ACTIVATION_MODULES`).

    Args:
        name: the module's qualified name (unused: the selection goes by the module).
        module: the module.

    Returns:
        Whether the module is selected.
    """
    return owns_parameters(module) or is_kind(module, ACTIVATION_MODULES)


def owns_parameters(module: nn.Module) -> bool:
    """Return whether ``module`` holds a parameter itself (not only through a child).

    Args:
        module: the module.

    Returns:
        Whether it holds a parameter directly.
    """
    return next(module.parameters(recurse=False), None) is not None


def feature_modules(selection: Selection | None, model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return the modules ``selection`` keeps (without ``types``: :func:`default_feature_module`'s).

    Args:
        selection: the user's selection (``None``: the default one).
        model: the model the modules are selected from.

    Returns:
        ``(name, module)`` of each kept module.
    """
    assert selection is not None
    where = default_feature_module if selection.types is None else None
    return selection.modules(model, where=where)


@dataclass(frozen=True)
class Histogram:
    """One row's histogram: ``counts[i]`` in ``[edges[i], edges[i + 1])``."""

    layer: str
    edges: np.ndarray
    counts: np.ndarray


class ActivationResult(NamedTuple):
    """What :class:`ActivationStatsTracker` measured over logging steps."""

    summary: FeatureSummary
    histograms: list[Histogram]  # a row each (none without ``histogram_bins``)


@named_arguments
class ActivationStatsTracker(LayerStat[ActivationResult]):
    """Measures per-layer statistics (:data:`SCALARS`) of the floating outputs of training forwards.

    They are accumulated over an epoch, no host sync per step (row ``{module}.{index or key}`` for
    a tuple, list or dict). Histograms span ``histogram_range`` or the previous epoch's range;
    NaN / Inf are counted, not binned. :meth:`end_step` finds the first module that went
    non-finite.

    Args:
        model: the model to instrument now (``None``: call :meth:`attach` later).
        types: only modules of these types (``None``: :func:`default_feature_module`'s).
        include: glob patterns on qualified module names to keep (``None``: every name).
        exclude: glob patterns on qualified module names to drop.
        histogram_bins: number of histogram bins per row; ``0``: no histograms.
        histogram_range: fixed ``(low, high)`` edges; ``None``: a running range.
        fused: use ``fused_feature_stats`` (compiled: one reading pass instead of six).
        owner: the public name errors give.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> with ActivationStatsTracker(model) as tracker:
        ...     _ = model(torch.randn(16, 4))
        ...     stats = tracker.summary()
        >>> stats.layers, stats.numel.tolist()
        (('0', '1', '2'), [128.0, 128.0, 16.0])
    """

    sums: torch.Tensor
    extremes: torch.Tensor
    hist: torch.Tensor
    edges: torch.Tensor
    has_edges: torch.Tensor

    def __init__(  # noqa: PLR0913 (a public constructor: one keyword per option)
        self,
        model: nn.Module | None = None,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        histogram_bins: int = 0,
        histogram_range: tuple[float, float] | None = None,
        fused: bool = False,
        owner: str = "ActivationStatsTracker",
    ) -> None:
        super().__init__(Selection.of(owner, types=types, include=include, exclude=exclude))
        self.bins = histogram_bins
        self.histogram_range = histogram_range
        self.workspace = Workspace()
        self._stats = fused_feature_stats if fused else feature_stats
        self._batched = not fused and not histogram_bins  # small outputs: stacked at drain
        self.add_layer_state("sums", reduce="sum", width=(NUM_SUMS,))
        self.add_layer_state("extremes", reduce="max", width=(2,), dtype=torch.float32)
        if self.bins:
            self.add_layer_state("hist", reduce="sum", width=(self.bins,))
            self.add_layer_state(
                "edges", reduce="same", width=(self.bins + 1,), dtype=torch.float32
            )
            known = float(histogram_range is not None)
            self.add_layer_state("has_edges", reduce="same", dtype=torch.bool, fill=known)
        self.first_nonfinite = FirstNonFinite(torch.device("cpu"))
        if model is not None:
            self.attach(model)

    def select(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """Return the modules to hook (see :func:`feature_modules`).

        Args:
            model: the model the modules are selected from.

        Returns:
            ``(name, module)`` of each module to hook.
        """
        return feature_modules(self.selection, model)

    def _attached(self, model: nn.Module, registry: HookRegistry) -> None:
        """Put the constants and the non-finite probe (its host buffer made once) on the device."""
        device = self.device
        self.first_nonfinite = FirstNonFinite(device)
        self._sign = torch.tensor(_SIGN, device=device)
        self._unit = torch.linspace(0.0, 1.0, self.bins + 1, device=device)

    def row(self, name: str, units: int = 0) -> int:
        """Return the row of ``name`` (a new one gets the fixed edges).

        Args:
            name: the row's name.
            units: the row's entries in a per-unit state.

        Returns:
            The row's index.
        """
        new = name not in self.rows
        index = super().row(name, units)
        if new and self.bins and self.histogram_range is not None:
            self.edges[index] = torch.linspace(*self.histogram_range, self.bins + 1)
        return index

    def observe(self, name: str, module: nn.Module, output: object) -> None:
        """Measure every floating tensor of ``output`` (small ones at :meth:`drain`).

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
        """Measure one non-empty tensor into row ``name``, a small one deferred to :meth:`drain`."""
        n = x.numel()
        if n == 0:
            return
        row = self.rows.get(name)
        row = self.row(name) if row is None else row
        if self._batched and n <= STACKED and not internals.is_compiling():
            self._defer((x.shape, x.dtype, x.device), row, self._snapshot(x))
            return
        stats = self._stats(x, self.workspace)
        self.sums[row].add_(stats[:NUM_SUMS])
        extremes = self.extremes[row]
        torch.maximum(extremes, stats[NUM_SUMS:] * self._sign, out=extremes)
        if self.bins:
            edges = self.edges[row]
            if self.histogram_range is None:
                known = self.has_edges[row]
                low = stats[NUM_SUMS]
                high = stats[NUM_SUMS + 1]
                torch.where(known, edges, linear_edges(low, high, self._unit), out=edges)
                known.fill_(True)
            bin_counts(x, edges[1:-1], self.hist[row])

    def drain(self) -> None:
        """Measure the copied small outputs, a stack per shape and dtype."""
        for _, rows, copies in self._drain_pending():
            stats = stacked_feature_stats(copies)
            index = self._pending.index(rows, stats.device)
            self.sums.index_add_(0, index, stats[:, :NUM_SUMS].to(self.sums.dtype))
            signed = stats[:, NUM_SUMS:] * self._sign
            self.extremes.scatter_reduce_(0, index[:, None].expand(-1, 2), signed, "amax")
        super().drain()

    @torch.no_grad()
    def end_step(self, step: int) -> None:
        """Mark ``step`` and the first row that went non-finite in :attr:`first_nonfinite`; no sync.

        Rows are in execution order.

        Args:
            step: the step that just ran, recorded with the row.
        """
        self.drain()
        if not self.rows:
            return
        bad = self.sums[:, _NONFINITE] > 0
        first = torch.argmax(bad.to(torch.uint8))
        self.first_nonfinite.mark(bad.any(), step, first)

    def take_first_nonfinite(self, step: int) -> tuple[int, str] | None:
        """End the measured step ``step``, and return the first non-finite output once found.

        The mark is read without waiting (on CUDA a step or so late), and returned only once
        in a fit: after that, and before it is found, this returns ``None`` and marks nothing.

        Args:
            step: the step that just ran (:meth:`end_step`).

        Returns:
            The step and the module of the first output that went non-finite (the first in
            execution order in that step), or ``None``.
        """
        if self.first_nonfinite.taken:
            return None
        self.end_step(step)
        found = self.first_nonfinite.take()
        if found is None:
            return None
        found_step, row = found
        return found_step, self.layers[row]

    def summary(self) -> FeatureSummary:
        """Return the statistics so far, reduced across ranks.

        Returns:
            The pooled statistics of every row.
        """
        return self.result().summary

    def summarize(self, states: dict[str, np.ndarray]) -> ActivationResult:
        """Turn the reduced host states into the statistics and histograms.

        Args:
            states: the sums, extremes and histogram states, reduced across ranks.

        Returns:
            The statistics, and a histogram per row when ``histogram_bins`` is set.
        """
        extremes = states["extremes"] * np.array(_SIGN)
        rows = zip(self.layers, states["edges"], states["hist"], strict=True) if self.bins else ()
        histograms = [Histogram(layer=n, edges=e, counts=c) for n, e, c in rows]
        return ActivationResult(summarize(self.layers, states["sums"], extremes), histograms)

    def tags(self, result: ActivationResult) -> dict[str, float]:
        """Return ``activations/{stat}/{layer}`` for every row that saw an element.

        Args:
            result: what :meth:`summarize` returned.

        Returns:
            The scalars, by tag.
        """
        stats = result.summary
        return {
            layer_tag(ACTIVATIONS, stat, layer): float(value)
            for stat in SCALARS
            for layer, value, n in zip(stats.layers, stats.column(stat), stats.numel, strict=True)
            if n > 0
        }

    def reset(self) -> None:
        """Start a new epoch; running-range edges span the finished one."""
        if self.bins and self.histogram_range is None and self.rows:
            local = {n: getattr(self, n).double().cpu().numpy() for n in ("sums", "extremes")}
            epoch = self._with_epoch(local)
            device = self.edges.device
            extremes = torch.as_tensor(epoch["extremes"] * np.array(_SIGN), device=device)
            seen = torch.as_tensor(epoch["sums"][:, NUM_SUMS - 1] > 0, device=device)  # rows seen
            edges = linear_edges(extremes[:, 0].float(), extremes[:, 1].float(), self._unit)
            torch.where(seen[:, None], edges, self.edges, out=self.edges)
            self.has_edges.copy_(seen)
        super().reset()
