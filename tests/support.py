"""Models and probes that several test files share.

``ReferenceMLP`` records in plain torch what each optimizer step applies; ``LongMLP`` and
``DeeperMLP`` are longer and deeper ``TinyMLP``s; ``Fault`` injects one fault into a layer at a
step; ``alarm_warnings`` reads the alarms' warnings back; ``StepWindow`` opens a measurement
window over the training steps; ``HookCounter`` counts the model's forward hooks per batch.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import TrainingAlarmWarning

from conftest import TinyMLP, dataset

LAYERS = ("net.0", "net.2", "net.4")


class ReferenceMLP(TinyMLP):
    """Records, independently of the library, what each optimizer step applies and changes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.steps: list[dict[str, dict[str, float]]] = []
        self._before: dict[str, torch.Tensor] = {}
        self._outputs: list[tuple[str, torch.Tensor]] = []
        self._out_sq: dict[str, float] = dict.fromkeys(LAYERS, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, module in enumerate(self.net):
            x = module(x)
            if f"net.{i}" in LAYERS and x.requires_grad:
                x.register_hook(lambda g, n=f"net.{i}": self._add_out(n, g))
        return x

    def _add_out(self, name: str, grad: torch.Tensor) -> None:
        self._out_sq[name] += float(grad.pow(2).sum())

    def _layer(self, name: str) -> list[torch.nn.Parameter]:
        return list(self.get_submodule(name).parameters())

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        step: dict[str, dict[str, float]] = {}
        for name in LAYERS:
            g = torch.cat([p.grad.flatten() for p in self._layer(name)])  # type: ignore[union-attr]
            w = torch.cat([p.detach().flatten() for p in self._layer(name)])
            self._before[name] = w.clone()
            step[name] = {
                "grad_norm": float(g.norm()),
                "grad_abs_mean": float(g.abs().mean()),
                "grad_abs_max": float(g.abs().max()),
                "weight_norm": float(w.norm()),
                "output_grad_norm": math.sqrt(self._out_sq[name]),
            }
            self._out_sq[name] = 0.0
        self.steps.append(step)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.steps or "update_ratio" in self.steps[-1][LAYERS[0]]:
            return  # no optimizer step since the last record (gradient accumulation)
        for name in LAYERS:
            w = torch.cat([p.detach().flatten() for p in self._layer(name)])
            before = self._before[name]
            self.steps[-1][name]["update_ratio"] = float((w - before).norm() / before.norm())


SPIKE_WARNS = {"spike": "warn"}


K = 30  # the step faults are injected at: well past AlarmRules.min_history


ALARM = re.compile(r"at optimizer step (\d+): (\S+)")


class LongMLP(TinyMLP):
    """TinyMLP with ``batches`` batches of 8 per epoch and a sane learning rate."""

    def __init__(self, batches: int = 40, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        self.batches = batches

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(n=8 * self.batches), batch_size=8)


class DeeperMLP(LongMLP):
    """LongMLP with two more hidden layers: sets of gradients of one shape (the hidden layers'
    biases and 16 x 16 weights), which the default quiet read stacks."""

    def __init__(self, batches: int = 40) -> None:
        super().__init__(batches=batches)
        hidden = [m for _ in range(2) for m in (nn.Linear(16, 16), nn.ReLU())]
        self.net = nn.Sequential(*self.net[:4], *hidden, self.net[4])


class Fault(pl.Callback):
    """Injects one fault into ``layer`` at optimizer step ``step`` (``global_step``)."""

    def __init__(self, kind: str, layer: str = "net.2", step: int = K) -> None:
        self.kind = kind
        self.layer = layer
        self.step = step

    def _params(self, pl_module: pl.LightningModule) -> list[torch.nn.Parameter]:
        return list(pl_module.get_submodule(self.layer).parameters())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if self.kind == "nan_weight" and trainer.global_step == self.step:
            with torch.no_grad():
                self._params(pl_module)[0][0, 0] = math.nan
        if self.kind == "kill" and trainer.global_step == self.step:
            with torch.no_grad():  # the ReLU after the layer never fires again: a dead layer
                self._params(pl_module)[1].fill_(-1e3)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        hit = trainer.global_step == self.step
        for p in self._params(pl_module):
            assert p.grad is not None
            if self.kind == "multiply" and hit:
                p.grad.mul_(1e6)
            if self.kind == "scale50" and hit:
                p.grad.mul_(50.0)
            if self.kind == "shrink" and trainer.global_step >= self.step:
                p.grad.mul_(1e-6)


def alarm_warnings(record: Iterator[warnings.WarningMessage]) -> list[tuple[int, str, str]]:
    """``(step, layer, message)`` of each TrainingAlarmWarning, in the order emitted."""
    out = []
    for w in record:
        if issubclass(w.category, TrainingAlarmWarning):
            step, layer = ALARM.search(str(w.message)).groups()  # type: ignore[union-attr]
            out.append((int(step), layer, str(w.message)))
    return out


class StepWindow(pl.Callback):
    """Opens ``start`` at each batch start, closes ``stop`` at the epoch end (before logging)."""

    def __init__(self, start: Callable[[], None], stop: Callable[[], None]) -> None:
        self.start = start
        self.stop = stop
        self.steps = 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.steps += 1
        self.start()

    def on_train_epoch_end(self, *args: Any) -> None:
        self.stop()


class RepeatedBatchMLP(TinyMLP):
    """Every batch holds the same 8 samples: a replayed batch after a resume is the same data."""

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8, 8, generator=g).repeat(4, 1)
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=8)


class HookCounter(pl.Callback):
    """Records how many forward hooks the model holds at each training batch."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.counts.append(sum(len(m._forward_hooks) for m in pl_module.modules()))
