"""The library's one histogram: log10 or linear edges, fixed or running, counts in a tensor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

__all__ = [
    "LOG10_EDGES",
    "LayerHistogram",
    "LayerHistograms",
    "Scale",
    "bin_counts",
    "linear_edges",
]

Scale = Literal["log10", "linear"]  # what is binned: log10 |x| or x itself

LOG10_EDGES = torch.arange(-12.0, 4.01, 0.5)  # half-decades of |x| from 1e-12 to 1e4


@torch.no_grad()
def bin_counts(
    x: torch.Tensor, inner: torch.Tensor, out: torch.Tensor, scale: Scale = "linear"
) -> None:
    """Add the counts of ``x``'s finite entries to ``out``, with no host sync.

    Deterministic, unlike ``torch.histc``.

    Args:
        x: the tensor whose finite entries are counted.
        inner: the ascending inner edges; bucket ``i`` is ``[inner[i - 1], inner[i])``.
        out: the counts added to, ``[len(inner) + 1]``.
        scale: what is binned: ``"log10"`` bins ``log10 |x|``, ``"linear"`` bins ``x`` itself.
    """
    flat = x.detach().reshape(-1)
    # In float32, as the edges are: under bf16 autocast an edge rounded to the values' dtype
    # would move counts to the next bin.
    flat = flat.abs().float() if scale == "log10" else flat.float()
    values = flat.clamp_min(1e-38).log10() if scale == "log10" else flat
    bucket = torch.bucketize(values, inner.to(values.dtype), right=True)
    spill = out.shape[0]  # non-finite entries go to a bucket past the end, then dropped
    bucket = torch.where(torch.isfinite(flat), bucket, spill)
    out += torch.bincount(bucket, minlength=spill + 1)[:spill].to(out.dtype)


def linear_edges(low: torch.Tensor, high: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
    """Return edges spanning ``[low, high]``, clamped to finite, an empty span given a tiny width.

    Args:
        low: the lower end of each span.
        high: the upper end of each span.
        unit: ``linspace(0, 1, bins + 1)``, the edges of the unit span.

    Returns:
        ``[..., bins + 1]`` edges.
    """
    low = torch.nan_to_num(low, nan=0.0, posinf=3e38, neginf=-3e38)
    high = torch.nan_to_num(high, nan=1.0, posinf=3e38, neginf=-3e38)
    span = (high - low).clamp_min(1e-12)
    return low.unsqueeze(-1) + span.unsqueeze(-1) * unit


@dataclass(frozen=True)
class LayerHistogram:
    """One layer's counts on the host.

    Attributes:
        limits: ``limits[i]`` is bucket ``i``'s right edge.
        counts: the count of each bucket.
    """

    limits: np.ndarray
    counts: np.ndarray

    @property
    def num(self) -> float:
        """The values counted."""
        return float(self.counts.sum())


class LayerHistograms:
    """Counts ``log10 |x|`` (``scale="linear"``: ``x``) per layer, as ``[num_layers, buckets]``.

    Args:
        num_layers: the layers, one row of counts each.
        edges: the ascending inner edges (default :data:`LOG10_EDGES`).
        device: where the counts are kept.
        scale: what is binned: ``"log10"`` bins ``log10 |x|``, ``"linear"`` bins ``x`` itself.

    Example:
        >>> hist = LayerHistograms(2, edges=torch.tensor([-1.0, 0.0, 1.0]))
        >>> hist.update([torch.tensor([0.05, 0.5, 5.0, 50.0]), torch.tensor([0.0, 3.0])], [0, 1])
        >>> hist.counts.tolist()
        [[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 1.0, 0.0]]
        >>> hist.result(0).limits.tolist()
        [-1.0, 0.0, 1.0, 2.0]
    """

    def __init__(
        self,
        num_layers: int,
        edges: torch.Tensor | None = None,
        device: torch.device | str | None = None,
        scale: Scale = "log10",
    ) -> None:
        self.scale: Scale = scale
        self.edges = (LOG10_EDGES if edges is None else edges).to(device, torch.float32)
        self.counts = torch.zeros(num_layers, len(self.edges) + 1, device=device)

    @torch.no_grad()
    def update(self, tensors: list[torch.Tensor], rows: list[int]) -> None:
        """Count the finite entries of ``tensors[i]`` into layer ``rows[i]``.

        Args:
            tensors: the tensors to count.
            rows: the layer row of each tensor.
        """
        for tensor, row in zip(tensors, rows, strict=True):
            bin_counts(tensor, self.edges, self.counts[row], self.scale)

    def reset(self) -> None:
        """Zero every count (a new epoch)."""
        self.counts.zero_()

    def host_counts(self) -> np.ndarray:
        """Return all counts, copied to the host once.

        Returns:
            ``[num_layers, buckets]`` counts as float64.
        """
        return self.counts.cpu().double().numpy()

    def limits(self) -> np.ndarray:
        """Return the right edges of the buckets.

        Returns:
            The right edge of each bucket; the last bucket ends one step after the last edge.
        """
        edges = self.edges.cpu().double().numpy()
        return np.concatenate([edges, [edges[-1] + (edges[-1] - edges[-2])]])

    def result(self, row: int) -> LayerHistogram:
        """Return one layer's histogram, on the host.

        Args:
            row: the layer's row.

        Returns:
            The layer's bucket limits and counts.
        """
        return LayerHistogram(self.limits(), self.host_counts()[row])
