"""Per-layer histograms of ``log10 |x|`` on fixed edges, accumulated on the device.

No ``torch.histc`` (its automatic range syncs with the host, and it is non-deterministic on CUDA):
fixed edges, ``torch.bucketize`` and ``index_add_``, so an update is a few kernels and no sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["LOG10_EDGES", "LayerHistogram", "LayerHistograms"]

LOG10_EDGES = torch.arange(-12.0, 4.01, 0.5)
"""Default inner edges of ``log10 |x|``: half-decades from 1e-12 to 1e4. Values below the first
edge (zeros included) fall in the first bucket, values above the last in the last one."""


@dataclass(frozen=True)
class LayerHistogram:
    """One layer's counts, in the form ``SummaryWriter.add_histogram_raw`` takes.

    ``limits[i]`` is the right edge of bucket ``i`` in ``log10 |x|``; the last is ``+inf``
    clamped to the last edge plus one step. Non-finite values are not counted.
    """

    limits: np.ndarray
    counts: np.ndarray

    @property
    def num(self) -> float:
        return float(self.counts.sum())

    def raw(self) -> dict[str, object]:
        """Keyword arguments for ``add_histogram_raw`` (bucket centres stand in for the values)."""
        lower = np.concatenate([[self.limits[0] - (self.limits[1] - self.limits[0])], self.limits])
        centres = (lower[:-1] + lower[1:]) / 2
        filled = np.flatnonzero(self.counts)
        return {
            "min": float(lower[filled[0]]),
            "max": float(self.limits[filled[-1]]),
            "num": self.num,
            "sum": float((centres * self.counts).sum()),
            "sum_squares": float((centres**2 * self.counts).sum()),
            "bucket_limits": self.limits.tolist(),
            "bucket_counts": self.counts.tolist(),
        }


class LayerHistograms:
    """``[layers, buckets]`` counts of ``log10 |x|`` over the tensors of each layer.

    Args:
        num_layers: rows.
        edges: inner bucket edges in ``log10 |x|`` (ascending); default :data:`LOG10_EDGES`.
        device: where the counts live.

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
    ) -> None:
        edges = LOG10_EDGES if edges is None else edges
        self.edges = edges.to(device=device, dtype=torch.float32)
        self.counts = torch.zeros(num_layers, len(edges) + 1, device=device)

    @torch.no_grad()
    def update(self, tensors: Sequence[torch.Tensor], rows: Sequence[int]) -> None:
        """Count every finite entry of ``tensors[i]`` into layer ``rows[i]`` (no host sync)."""
        num_buckets = self.counts.shape[1]
        for tensor, row in zip(tensors, rows, strict=True):
            mag = tensor.detach().abs().float().flatten()
            finite = torch.isfinite(mag)
            bucket = torch.bucketize(mag.clamp_min(1e-38).log10(), self.edges, right=True)
            # Non-finite entries go to a spill bucket that is dropped.
            bucket = torch.where(finite, bucket, num_buckets)
            counts = torch.bincount(bucket, minlength=num_buckets + 1)[:num_buckets]
            self.counts[row].add_(counts.to(self.counts.dtype))

    def reset(self) -> None:
        """Zero every count (a new epoch)."""
        self.counts.zero_()

    def host_counts(self) -> np.ndarray:
        """All counts, copied to the host once."""
        return self.counts.cpu().double().numpy()

    def limits(self) -> np.ndarray:
        """Right edges of the buckets; the last bucket ends one step after the last edge."""
        edges = self.edges.cpu().double().numpy()
        return np.concatenate([edges, [edges[-1] + (edges[-1] - edges[-2])]])

    def result(self, row: int) -> LayerHistogram:
        """One layer's histogram, on the host."""
        return LayerHistogram(self.limits(), self.host_counts()[row])
