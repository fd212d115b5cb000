"""How ``FeatureMapCallback`` takes its probe from a training batch: the model input, the labels,
the first samples, copied, and moved to the model's device."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_hooks.errors import LightningHooksError

__all__ = [
    "ProbeInputError",
    "default_input",
    "default_labels",
    "has_tensor",
    "head",
    "to_device",
]


class ProbeInputError(LightningHooksError, TypeError):
    """No usable model input in the first training batch: a configuration error, which the
    guard lets through (it propagates the library's own errors) so the fit stops there."""


def has_tensor(x: Any) -> bool:
    """Whether ``x`` is a tensor or a (nested) list, tuple or mapping holding one."""
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, list | tuple):
        return any(has_tensor(item) for item in x)
    return isinstance(x, Mapping) and any(has_tensor(item) for item in x.values())


def default_input(batch: Any) -> Any:
    """The model input of a batch: the batch itself if a tensor, else its first element."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, list | tuple) and batch:
        return batch[0]
    raise ProbeInputError(
        f"FeatureMapCallback(input_fn=None): cannot find the model input in a batch of type "
        f"{type(batch).__name__}; pass input_fn=lambda batch: ... or probe=..."
    )


def default_labels(batch: Any, size: int) -> torch.Tensor | None:
    """The second element of a tuple batch when it holds one label per sample, else ``None``."""
    if isinstance(batch, list | tuple) and len(batch) > 1:
        labels = batch[1]
        if isinstance(labels, torch.Tensor) and labels.dim() == 1 and len(labels) >= size:
            return labels[:size].detach().clone()
    return None


def head(x: Any, size: int) -> Any:
    """The first ``size`` samples of a tensor or a (nested) structure of tensors, copied."""
    if isinstance(x, torch.Tensor):
        return x[:size].detach().clone()
    if isinstance(x, list | tuple):
        return type(x)(head(item, size) for item in x)
    if isinstance(x, Mapping):
        return {key: head(item, size) for key, item in x.items()}
    return x


def to_device(x: Any, device: torch.device) -> Any:
    """``x`` (a tensor or a nested structure of tensors) on ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, list | tuple):
        return type(x)(to_device(item, device) for item in x)
    if isinstance(x, Mapping):
        return {key: to_device(item, device) for key, item in x.items()}
    return x
