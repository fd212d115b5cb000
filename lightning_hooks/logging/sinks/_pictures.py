"""Figures and image tensors as ``uint8`` pixel arrays, for the loggers that take pixels."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["figure_pixels", "image_pixels", "png_bytes"]


def figure_pixels(figure: Figure) -> np.ndarray:
    """``[H, W, 3]`` ``uint8`` RGB pixels of ``figure``, rendered as TensorBoard renders it.

    Example:
        >>> figure_pixels(Figure(figsize=(2, 1), dpi=50)).shape
        (50, 100, 3)
    """
    canvas = FigureCanvasAgg(figure)
    canvas.draw()  # type: ignore[no-untyped-call]
    rgba: np.ndarray = np.asarray(canvas.buffer_rgba())  # type: ignore[no-untyped-call]
    pixels: np.ndarray = rgba[:, :, :3].copy()
    return pixels


def image_pixels(image: Any) -> np.ndarray:
    """A ``CHW`` tensor in ``[0, 1]`` as ``uint8`` pixels: ``[H, W]`` for one channel, else
    ``[H, W, C]``.

    Example:
        >>> import torch
        >>> image_pixels(torch.tensor([[[0.0, 1.0]]])).tolist()
        [[0, 255]]
    """
    pixels = (image.detach().float().clamp(0, 1) * 255).round().byte().cpu().numpy()
    return pixels[0] if pixels.shape[0] == 1 else np.transpose(pixels, (1, 2, 0))


def png_bytes(pixels: np.ndarray) -> bytes:
    """``uint8`` pixels encoded as PNG."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()
