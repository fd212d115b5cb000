"""Layer outputs as images: channel grids for conv outputs, sample-by-feature maps for dense."""

from __future__ import annotations

import math

import torch

__all__ = ["feature_map_grid"]


def _normalize(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Min-max scale to ``[0, 1]`` over ``dims``; a constant slice becomes 0."""
    low = x.amin(dim=dims, keepdim=True)
    span = x.amax(dim=dims, keepdim=True) - low
    return torch.where(span > 0, (x - low) / span.clamp_min(1e-12), torch.zeros_like(x))


def _tile(maps: torch.Tensor, pad: int) -> torch.Tensor:
    """``[n, h, w]`` maps to one ``[H, W]`` grid, near square, separated by ``pad`` white pixels."""
    n, h, w = maps.shape
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    grid = torch.ones(rows * (h + pad) - pad, cols * (w + pad) - pad)
    for i in range(n):
        r, c = divmod(i, cols)
        grid[r * (h + pad) : r * (h + pad) + h, c * (w + pad) : c * (w + pad) + w] = maps[i]
    return grid


def feature_map_grid(output: torch.Tensor, channels: int = 16, min_size: int = 32) -> torch.Tensor:
    """A ``[1, H, W]`` image in ``[0, 1]`` (grayscale, ``CHW``) of one layer's output on a batch.

    * ``[N, C, H, W]`` (``Conv2d``): the first ``channels`` channels of the first sample, each
      scaled to its own min-max, tiled in a near-square grid; maps smaller than ``min_size``
      pixels are enlarged by pixel repetition.
    * ``[N, C, D, H, W]`` (``Conv3d``): the same, at the middle depth.
    * ``[N, C, L]`` (``Conv1d``): the first sample, one row per channel (first ``channels``).
    * ``[N, F]`` (``Linear``): the whole batch, one row per sample, one column per feature.

    Args:
        output: the layer's output for a batch.
        channels: how many channels to draw.
        min_size: smallest side, in pixels, of a drawn map.

    Raises:
        ValueError: the output has fewer than 2 or more than 5 dimensions.

    Example:
        >>> feature_map_grid(torch.randn(2, 6, 8, 8), channels=4).shape
        torch.Size([1, 65, 65])
        >>> feature_map_grid(torch.randn(5, 7)).shape
        torch.Size([1, 5, 7])
    """
    x = output.detach().float().cpu()
    if x.dim() == 5:
        x = x[:, :, x.shape[2] // 2]
    if x.dim() == 4:
        maps = _normalize(x[0, :channels], dims=(1, 2))
        scale = max(1, math.ceil(min_size / min(maps.shape[1:])))
        maps = maps.repeat_interleave(scale, dim=1).repeat_interleave(scale, dim=2)
        return _tile(maps, pad=1)[None]
    if x.dim() == 3:
        return _normalize(x[0, :channels], dims=(1,))[None]
    if x.dim() == 2:
        return _normalize(x, dims=(0, 1))[None]
    raise ValueError(
        f"feature_map_grid(output=...): expected a tensor with 2 to 5 dimensions, got shape "
        f"{tuple(output.shape)}"
    )
