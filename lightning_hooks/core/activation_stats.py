"""Statistics of what each layer produces, accumulated on the device: no Lightning here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_hooks.core.collectives import reduce_across_ranks
from lightning_hooks.core.feature_stats import (
    NUM_SUMS,
    FeatureSummary,
    Workspace,
    feature_stats,
    fused_feature_stats,
    histogram_counts,
    summarize,
)
from lightning_hooks.core.nonfinite import FirstNonFinite
from lightning_hooks.core.registry import HookOwner, HookRegistry
from lightning_hooks.core.selection import ModuleTypes, Patterns
from lightning_hooks.core.tensors import is_training_forward, iter_float_tensors

__all__ = ["ACTIVATION_MODULES", "ActivationStatsTracker", "Histogram", "default_feature_module"]

ACTIVATION_MODULES: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.PReLU,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.SiLU,
    nn.Mish,
    nn.Hardswish,
    nn.Sigmoid,
    nn.Tanh,
    nn.Softplus,
)
"""Activation module types the default selection includes."""

_NONFINITE = 4  # column of the non-finite count in the sums
_SIGN = (-1.0, 1.0)  # extremes are kept as (-min, max) so one max-reduce pools both


def default_feature_module(name: str, module: nn.Module) -> bool:
    """The default selection: modules owning parameters directly, and activation modules.

    Example:
        >>> default_feature_module("0", nn.Linear(2, 2)), default_feature_module("1", nn.ReLU())
        (True, True)
        >>> default_feature_module("2", nn.Sequential()), default_feature_module("3", nn.Dropout())
        (False, False)
    """
    owns = any(True for _ in module.parameters(recurse=False))
    return owns or isinstance(module, ACTIVATION_MODULES)


@dataclass(frozen=True)
class Histogram:
    """Host-side histogram of one row's outputs: ``counts[i]`` in ``[edges[i], edges[i + 1])``."""

    layer: str
    edges: np.ndarray
    counts: np.ndarray


class _State:
    """The on-device tensors, grown by one row when an output appears for the first time."""

    def __init__(self, device: torch.device, bins: int, fixed: tuple[float, float] | None) -> None:
        dtype = torch.float32 if device.type == "mps" else torch.float64
        self.sums = torch.zeros(0, NUM_SUMS, dtype=dtype, device=device)
        self.extremes = torch.zeros(0, 2, device=device)
        self.hist = torch.zeros(0, bins, dtype=dtype, device=device)
        self.edges = torch.zeros(0, bins + 1, device=device)
        self.has_edges = torch.zeros(0, dtype=torch.bool, device=device)
        self.sign = torch.tensor(_SIGN, device=device)
        self.unit = torch.linspace(0.0, 1.0, bins + 1, device=device)
        self.fixed = None if fixed is None else torch.linspace(*fixed, bins + 1, device=device)

    def grow(self) -> None:
        self.sums = torch.cat([self.sums, self.sums.new_zeros(1, NUM_SUMS)])
        self.extremes = torch.cat([self.extremes, self.extremes.new_full((1, 2), -torch.inf)])
        self.hist = torch.cat([self.hist, self.hist.new_zeros(1, self.hist.shape[1])])
        new_edges = self.edges.new_zeros(1, self.edges.shape[1])
        if self.fixed is not None:
            new_edges.copy_(self.fixed)
        self.edges = torch.cat([self.edges, new_edges])
        self.has_edges = torch.cat(
            [self.has_edges, self.has_edges.new_full((1,), self.fixed is not None)]
        )

    def edges_from(self, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        low = torch.nan_to_num(low, nan=0.0, posinf=3e38, neginf=-3e38)
        high = torch.nan_to_num(high, nan=1.0, posinf=3e38, neginf=-3e38)
        span = (high - low).clamp_min(1e-12)
        return low.unsqueeze(-1) + span.unsqueeze(-1) * self.unit


def _model_device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


class ActivationStatsTracker(HookOwner):
    """Per-layer statistics of module outputs over an epoch, on the device, no host sync per step.

    A forward hook on each selected module measures every floating tensor of its output (tuple,
    list and dict outputs give one row per tensor, named ``{module}.{index or key}``) in
    training forwards only: sum, sum of squares, sum of ``|x|``, exact zeros, NaN / Inf count,
    element count, min and max, pooled over every element of every call. A module called twice
    in a forward is measured twice. :meth:`summary` gives the epoch's mean, std, min, max,
    mean ``|x|``, zero fraction and non-finite count per row.

    Optional histograms bin every output on the device with fixed edges (``histogram_range``) or
    a running range: a row's edges for an epoch span the previous epoch's min and max (the first
    epoch: the row's first output). Values outside the edges count in the end bins.

    Call :meth:`end_step` after each training step: it keeps, in :attr:`first_nonfinite`, the
    first module in execution order whose output contained NaN / Inf, and the step (a few tiny
    kernels per step, instead of per output).

    Rows are created in the order outputs first appear; under ``torch.distributed`` every rank
    runs the same model, so every rank has the same rows when :meth:`result` reduces them.

    Args:
        model: the model to instrument.
        types: modules of these types (default: :func:`default_feature_module`).
        include: glob patterns on module names to keep.
        exclude: glob patterns on module names to drop.
        histogram_bins: number of histogram bins per row; ``0``: no histograms.
        histogram_range: fixed ``(low, high)`` edges; ``None``: a running range.
        fused: compute the statistics with ``fused_feature_stats`` (``torch.compile``: one
            reading pass instead of six; compiled on the first training step).

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> with ActivationStatsTracker(model) as tracker:
        ...     _ = model(torch.randn(16, 4))
        ...     stats = tracker.summary()
        >>> stats.layers, stats.numel.tolist()
        (('0', '1', '2'), [128.0, 128.0, 16.0])
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        types: ModuleTypes = None,
        include: Patterns = None,
        exclude: Patterns = None,
        histogram_bins: int = 0,
        histogram_range: tuple[float, float] | None = None,
        fused: bool = False,
    ) -> None:
        self.registry = HookRegistry(model)
        where = default_feature_module if types is None else None
        modules = self.registry.modules(types=types, include=include, exclude=exclude, where=where)
        if not modules:
            raise ValueError(
                "ActivationStatsTracker: no module selected "
                f"(types={types!r}, include={include!r}, exclude={exclude!r})"
            )
        self.bins = histogram_bins
        self.histogram_range = histogram_range
        self.rows: dict[str, int] = {}
        self.workspace = Workspace()
        self._stats = fused_feature_stats if fused else feature_stats
        self._state: _State | None = None
        # Made here, not in a hook: its host buffer is set up once, outside any training step.
        self.first_nonfinite = FirstNonFinite(_model_device(model))
        for name, module in modules:
            self.registry.forward_hook(module, self._hook(name), gated=True)

    @property
    def layers(self) -> tuple[str, ...]:
        """Row names, in the order their outputs first appeared."""
        return tuple(self.rows)

    def _hook(self, name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not is_training_forward(module):
                return
            for suffix, tensor in iter_float_tensors(output):
                if tensor.numel() > 0:
                    self._observe(self._row(name + suffix, tensor.device), tensor)

        return hook

    def _row(self, layer: str, device: torch.device) -> int:
        row = self.rows.get(layer)
        if row is None:
            if self._state is None:
                self._state = _State(device, self.bins, self.histogram_range)
                if self.first_nonfinite.device != device:
                    self.first_nonfinite = FirstNonFinite(device)
            row = self.rows[layer] = len(self.rows)
            self._state.grow()
        return row

    @torch.no_grad()
    def _observe(self, row: int, x: torch.Tensor) -> None:
        state = self._state
        assert state is not None
        stats = self._stats(x, self.workspace)
        state.sums.select(0, row).add_(stats[:NUM_SUMS])
        extremes = state.extremes.select(0, row)
        torch.maximum(extremes, stats[NUM_SUMS:] * state.sign, out=extremes)
        if self.bins:
            self._bin(state, row, x, stats[NUM_SUMS], stats[NUM_SUMS + 1])

    def _bin(
        self, state: _State, row: int, x: torch.Tensor, low: torch.Tensor, high: torch.Tensor
    ) -> None:
        edges = state.edges.select(0, row)
        if self.histogram_range is None:
            known = state.has_edges.select(0, row)
            torch.where(known, edges, state.edges_from(low, high), out=edges)
            known.fill_(True)
        histogram_counts(x, edges, state.hist.select(0, row))

    @torch.no_grad()
    def end_step(self, step: int) -> None:
        """Record ``step`` in :attr:`first_nonfinite` if an output went non-finite, no sync.

        Rows are numbered in the order outputs first appear, which is execution order, and until
        the first mark no row had a non-finite value: the first row with one now is the first
        module in execution order whose output went non-finite in this step.
        """
        if self._state is None:
            return
        bad = self._state.sums[:, _NONFINITE] > 0
        first = torch.argmax(bad.to(torch.uint8))
        self.first_nonfinite.mark(bad.any(), step, first)

    def _pooled(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Reduce across ranks and copy to the host once: sums, extremes, counts, edges."""
        state = self._state
        assert state is not None
        rows = len(self.rows)
        summed = reduce_across_ranks(torch.cat([state.sums, state.hist], dim=1), "sum")
        extremes = reduce_across_ranks(state.extremes, "max")
        dtype = summed.dtype
        parts = (summed, extremes.to(dtype), state.edges.to(dtype))
        packed = torch.cat([part.flatten() for part in parts])
        host = packed.cpu().numpy()
        width = NUM_SUMS + self.bins
        summed_np = host[: rows * width].reshape(rows, width)
        extremes_np = host[rows * width : rows * (width + 2)].reshape(rows, 2) * np.array(_SIGN)
        edges_np = host[rows * (width + 2) :].reshape(rows, self.bins + 1)
        return summed_np[:, :NUM_SUMS], extremes_np, summed_np[:, NUM_SUMS:], edges_np

    def summary(self) -> FeatureSummary:
        """The statistics so far (reduced across ranks), copied to the host once."""
        return self.result()[0]

    def result(self) -> tuple[FeatureSummary, list[Histogram]]:
        """Statistics and histograms so far (reduced across ranks), copied to the host once."""
        if self._state is None:
            empty = np.zeros((0, NUM_SUMS))
            return summarize((), empty, np.zeros((0, 2))), []
        sums, extremes, counts, edges = self._pooled()
        layers = self.layers
        hists = []
        if self.bins:
            hists = [Histogram(layers[i], edges[i], counts[i]) for i in range(len(layers))]
        return summarize(layers, sums, extremes), hists

    def reset(self) -> None:
        """Start a new epoch: zero the sums; running-range edges span the finished epoch."""
        state = self._state
        if state is None:
            return
        if self.bins and self.histogram_range is None:
            low, high = -state.extremes[:, 0], state.extremes[:, 1]
            seen = state.sums[:, NUM_SUMS - 1] > 0
            torch.where(seen[:, None], state.edges_from(low, high), state.edges, out=state.edges)
            state.has_edges.copy_(seen)
        state.sums.zero_()
        state.hist.zero_()
        state.extremes.fill_(-torch.inf)
