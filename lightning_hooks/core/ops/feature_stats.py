"""A float32 vector of :data:`FEATURE_STATS` per module output, and many such vectors pooled."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lightning_hooks.core.ops.tensors import Workspace, piece_size

__all__ = [
    "CHUNK",
    "FEATURE_STATS",
    "NUM_SUMS",
    "SIGN_COUNTS",
    "STACKED",
    "FeatureSummary",
    "feature_stats",
    "fused_feature_stats",
    "stacked_feature_stats",
    "summarize",
]

FEATURE_STATS = ("sum", "sum_sq", "sum_abs", "zeros", "nonfinite", "numel", "min", "max")
"""Entries of :func:`feature_stats`: the first :data:`NUM_SUMS` pool by addition."""
NUM_SUMS = 6
_MIN = FEATURE_STATS.index("min")
_MAX = FEATURE_STATS.index("max")

CHUNK = 1 << 19  # elements read at a time on the CPU (2 MiB in float32: stays in cache)


@torch.no_grad()
def feature_stats(x: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
    """Return the ``[8]`` float32 :data:`FEATURE_STATS` of a non-empty tensor.

    The tensor is read a piece at a time (no host sync); NaN propagates into all but the counts.

    Args:
        x: the non-empty tensor read.
        workspace: where the temporaries are kept (``None``: a fresh one).

    Returns:
        The ``[8]`` float32 statistics.

    Example:
        >>> feature_stats(torch.tensor([-1.0, 0.0, 2.0, 0.0])).tolist()
        [1.0, 5.0, 3.0, 2.0, 0.0, 4.0, -1.0, 2.0]
    """
    flat = x.detach().reshape(-1)
    n = flat.numel()
    chunk = piece_size(x.device, CHUNK)
    scratch = (workspace or Workspace()).get(min(n, chunk), x.dtype, x.device)
    if n <= chunk:
        return _piece_stats(flat, scratch)
    pieces = torch.stack([_piece_stats(flat[i : i + chunk], scratch) for i in range(0, n, chunk)])
    extremes = [pieces[:, _MIN].min().view(1), pieces[:, _MAX].max().view(1)]
    return torch.cat([pieces[:, :NUM_SUMS].sum(dim=0), *extremes])


def _piece_stats(flat: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Return the ``[8]`` float32 statistics of one flat piece, temporaries in ``scratch``."""
    f32 = torch.float32
    low, high = torch.aminmax(flat)
    buf = scratch[: flat.numel()]
    sum_abs = torch.abs(flat, out=buf).sum(dtype=f32)
    finite = torch.lt(buf, torch.inf, out=buf).sum(dtype=f32)  # |x| < inf: not NaN / Inf
    zeros = torch.eq(flat, 0, out=buf).sum(dtype=f32)
    square = torch.linalg.vector_norm(flat, 2, dtype=f32).square()
    numel = finite.new_full((), flat.numel())
    sums = [flat.sum(dtype=f32), square, sum_abs, zeros, numel - finite, numel]
    return torch.stack([*sums, low.to(f32), high.to(f32)])


STACKED = 1 << 16  # elements: an output this small is measured with others at the step's end

SIGN_COUNTS = frozenset({"cpu"})  # devices counting by sums of signs (comparisons are slow)


@torch.no_grad()
def stacked_feature_stats(x: torch.Tensor) -> torch.Tensor:
    """Return the :func:`feature_stats` of each tensor stacked in ``x``, read all at once.

    Args:
        x: ``k`` tensors of one shape, stacked on the first dimension.

    Returns:
        ``[k, 8]`` float32 statistics.
    """
    f32 = torch.float32
    flat = x.detach().reshape(x.shape[0], -1)
    magnitude = flat.abs()
    numel = torch.full((flat.shape[0],), flat.shape[1], dtype=f32, device=flat.device)
    if flat.device.type in SIGN_COUNTS:
        low = flat.amin(1)
        high = flat.amax(1)
        finite = torch.nan_to_num(torch.sign(torch.inf - magnitude), nan=0.0).sum(1, dtype=f32)
        zeros = numel - torch.sign(torch.nan_to_num(magnitude, nan=1.0)).sum(1, dtype=f32)
    else:
        low, high = torch.aminmax(flat, dim=1)
        finite = torch.lt(magnitude, torch.inf).sum(1, dtype=f32)  # not NaN / Inf
        zeros = torch.eq(flat, 0).sum(1, dtype=f32)
    square = torch.linalg.vector_norm(flat, 2, dim=1, dtype=f32).square()
    columns = [flat.sum(1, dtype=f32), square, magnitude.sum(1, dtype=f32), zeros]
    return torch.stack([*columns, numel - finite, numel, low.to(f32), high.to(f32)], dim=1)


def _one_pass_stats(x: torch.Tensor) -> torch.Tensor:
    # for torch.compile: every reduction reads the same input, so they fuse into one pass
    """Return the ``[8]`` statistics of ``x`` in reductions that ``torch.compile`` fuses."""
    f = x.reshape(-1).float()
    absolute = f.abs()
    nonfinite = (~(absolute < torch.inf)).float().sum()  # NaN and Inf
    numel = torch.full((), f.numel(), dtype=f.dtype, device=f.device)
    sums = [f.sum(), (f * f).sum(), absolute.sum(), (f == 0).float().sum(), nonfinite, numel]
    return torch.stack([*sums, f.amin(), f.amax()])


@functools.cache
def _compiled() -> Callable[[torch.Tensor], torch.Tensor]:
    """Return :func:`_one_pass_stats` compiled, made once."""
    return torch.compile(_one_pass_stats, dynamic=True)


@torch.no_grad()
def fused_feature_stats(x: torch.Tensor, workspace: Workspace | None = None) -> torch.Tensor:
    """Return :func:`feature_stats` compiled into one reading pass.

    Args:
        x: the non-empty tensor read; a non-contiguous one is read eagerly.
        workspace: where the eager read keeps its temporaries.

    Returns:
        The ``[8]`` float32 statistics.
    """
    if not x.is_contiguous():
        return feature_stats(x, workspace)
    return _compiled()(x.detach())  # a leaf: Dynamo would read a non-leaf's .grad


@dataclass(frozen=True)
class FeatureSummary:
    """Host-side statistics pooled over every element observed.

    Each statistic is an array with a row per name of ``layers`` (``std`` Bessel-corrected,
    ``nonfinite`` the count of NaN / Inf).
    """

    layers: tuple[str, ...]
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray
    abs_mean: np.ndarray
    zero_fraction: np.ndarray
    nonfinite: np.ndarray
    numel: np.ndarray
    sum: np.ndarray
    sum_sq: np.ndarray

    def column(self, stat: str) -> np.ndarray:
        """Return one statistic for every row.

        Args:
            stat: the statistic's attribute name.

        Returns:
            The statistic's array.
        """
        return getattr(self, stat)  # type: ignore[no-any-return]


def summarize(layers: tuple[str, ...], sums: np.ndarray, extremes: np.ndarray) -> FeatureSummary:
    """Turn pooled sums and extremes into statistics.

    Args:
        layers: the name of each row.
        sums: the pooled ``[rows, NUM_SUMS]`` sums.
        extremes: the pooled ``[rows, 2]`` (min, max).

    Returns:
        The statistics of each row.
    """
    total, sq, absolute, zeros, nonfinite, n = sums.astype(np.float64).T
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = total / n
        var = (sq - total * mean) / (n - 1)
        return FeatureSummary(
            layers=layers,
            mean=mean,
            std=np.where(n > 1, np.sqrt(np.maximum(var, 0.0)), np.nan),
            min=extremes[:, 0].astype(np.float64),
            max=extremes[:, 1].astype(np.float64),
            abs_mean=absolute / n,
            zero_fraction=zeros / n,
            nonfinite=nonfinite,
            numel=n,
            sum=total,
            sum_sq=sq,
        )
