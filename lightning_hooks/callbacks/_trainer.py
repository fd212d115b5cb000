"""What the callbacks read off the Trainer without a host sync: AMP's scale, the clipping."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch

__all__ = ["clip_of", "grad_scale"]


def grad_scale(trainer: pl.Trainer) -> torch.Tensor | None:
    """The AMP GradScaler's scale as a device tensor (no sync), or ``None`` without AMP."""
    scaler: Any = getattr(trainer.strategy.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else None


def clip_of(trainer: pl.Trainer) -> tuple[float, str] | None:
    """The Trainer's gradient clipping, ``(value, algorithm)``, or ``None``."""
    if not trainer.gradient_clip_val:
        return None
    algorithm = trainer.gradient_clip_algorithm or "norm"
    return float(trainer.gradient_clip_val), str(getattr(algorithm, "value", algorithm))
