"""The reference row: per-layer statistics the way tutorials show it, with ``.item()`` per value.

Forward hooks on every leaf module read mean, std, min and max of the output, and hooks on every
parameter read the gradient norm, each with ``.item()`` into Python lists: one host sync per
statistic per layer per step. Kept in its own file so the sync counter can attribute its syncs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["TutorialHooks"]


class TutorialHooks(pl.Callback):
    """Forward hooks + parameter hooks calling ``.item()`` per statistic per step."""

    def __init__(self) -> None:
        self.values: defaultdict[str, list[float]] = defaultdict(list)
        self.handles: list[RemovableHandle] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name, module in pl_module.named_modules():
            if name and not list(module.children()):
                self.handles.append(module.register_forward_hook(self._forward(name)))
        for name, param in pl_module.named_parameters():
            self.handles.append(param.register_hook(self._grad(name)))  # type: ignore[no-untyped-call]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _forward(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not (module.training and isinstance(output, torch.Tensor)):
                return
            out = output.detach()
            self.values[f"{name}/mean"].append(out.mean().item())
            self.values[f"{name}/std"].append(out.std().item())
            self.values[f"{name}/min"].append(out.min().item())
            self.values[f"{name}/max"].append(out.max().item())

        return hook

    def _grad(self, name: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self.values[f"{name}/grad_norm"].append(grad.norm().item())

        return hook
