"""What each callback costs, against a bare run, on a small CNN.

A small CNN (4 x conv 3x3 + BatchNorm + Tanh, 16 channels, 16x16 inputs, batch 32) trains for 2
epochs of 20 batches under each configuration, interleaved round by round in one process so that
a load change on a shared machine hits all of them. Two timing callbacks, first and last in the
list, bracket every other callback: a *step* runs from the first one's ``on_train_batch_start``
to the last one's ``on_train_batch_end`` (forward, backward, optimizer step, every hook), an
*epoch end* from the first one's ``on_train_epoch_end`` to the last one's. Each round gives the
median step of the fit against that round's bare run; the table gives the median and range of
those ratios over rounds, and the median epoch-end time.

A second table measures the per-step hooks without Lightning, step by step: identical copies of
the model (one bare, one per configuration) take turns, one training step each, for ``--steps``
turns, and each turn's time is divided by the bare copy's time in the same turn. This is the
steadier number on a shared machine: load changes between turns, hardly within one.

Run: ``python examples/overhead.py [--rounds 7] [--steps 300]``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import FeatureMapCallback, LayerTimeCallback, SaturationCallback
from lightning_hooks.core import LayerTimer, SaturationTracker


class SmallCNN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks: list[nn.Module] = []
        for cin, cout in ((3, 16), (16, 16), (16, 16), (16, 16)):
            blocks += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.Tanh()]
        self.features = nn.Sequential(*blocks)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(640, 3, 16, 16, generator=g), torch.randint(0, 10, (640,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=32)


class _Times:
    def __init__(self) -> None:
        self.steps: list[float] = []
        self.epoch_ends: list[float] = []
        self.mark = 0.0


class _Open(pl.Callback):
    def __init__(self, times: _Times) -> None:
        self.times = times

    def on_train_batch_start(self, *args: Any) -> None:
        self.times.mark = time.perf_counter()

    def on_train_epoch_end(self, *args: Any) -> None:
        self.times.mark = time.perf_counter()


class _Close(pl.Callback):
    def __init__(self, times: _Times) -> None:
        self.times = times

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.steps.append(time.perf_counter() - self.times.mark)

    def on_train_epoch_end(self, *args: Any) -> None:
        self.times.epoch_ends.append(time.perf_counter() - self.times.mark)


CONFIGS: dict[str, Callable[[], list[pl.Callback]]] = {
    "bare": lambda: [],
    "LayerTimeCallback() (every 50th step)": lambda: [LayerTimeCallback()],
    "LayerTimeCallback(every_n_steps=1)": lambda: [LayerTimeCallback(every_n_steps=1)],
    "FeatureMapCallback()": lambda: [FeatureMapCallback()],
    "FeatureMapCallback(embedding='features.11')": lambda: [
        FeatureMapCallback(embedding="features.11")
    ],
    "SaturationCallback(every_n_steps=1)": lambda: [SaturationCallback(every_n_steps=1)],
}


def _fit(callbacks: list[pl.Callback], root: str) -> _Times:
    times = _Times()
    trainer = pl.Trainer(
        max_epochs=2,
        limit_train_batches=20,
        accelerator="cpu",
        logger=TensorBoardLogger(root, name="overhead"),
        callbacks=[_Open(times), *callbacks, _Close(times)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(SmallCNN())
    return times


def _plain_step(model: SmallCNN, opt: torch.optim.Optimizer, x: torch.Tensor, y: Any) -> float:
    start = time.perf_counter()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - start


def _plain_loop(steps: int) -> None:
    models = {name: SmallCNN() for name in ("bare", "off", "logging_step", "saturation")}
    off, logging_step = LayerTimer(models["off"]), LayerTimer(models["logging_step"])
    tracker = SaturationTracker(models["saturation"])
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()}
    x, y = next(iter(models["bare"].train_dataloader()))
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for turn in range(steps + 20):
        logging_step.start_step()
        for name, model in models.items():
            seconds[name].append(_plain_step(model, opts[name], x, y))
        logging_step.end_step()
        if turn % 50 == 0:
            logging_step.reset()
    labels = {
        "off": "LayerTimer, quiet step",
        "logging_step": "LayerTimer, logging step",
        "saturation": "SaturationTracker (4 Tanh)",
    }
    bare = np.array(seconds["bare"][20:])
    print(f"\n| plain loop, {steps} interleaved steps | step vs bare: median (25-75%) |")
    print("| --- | --- |")
    print(f"| bare step | {1e3 * np.median(bare):.2f} ms |")
    for name, label in labels.items():
        ratio = np.array(seconds[name][20:]) / bare
        low, mid, high = np.percentile(ratio, [25, 50, 75])
        print(f"| {label} | {mid:.3f}x ({low:.3f}-{high:.3f}) |")
    for hooks in (off, logging_step, tracker):
        hooks.remove()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # a shared 2-core machine: one thread is the stable measurement
    step_ms: dict[str, list[float]] = {name: [] for name in CONFIGS}
    epoch_end_ms: dict[str, list[float]] = {name: [] for name in CONFIGS}
    with tempfile.TemporaryDirectory() as root:
        _fit([], root)  # warm-up
        for _ in range(args.rounds):
            for name, make in CONFIGS.items():
                times = _fit(make(), root)
                step_ms[name].append(1e3 * float(np.median(times.steps)))
                epoch_end_ms[name].extend(1e3 * t for t in times.epoch_ends)
    bare = np.array(step_ms["bare"])
    print(
        f"| configuration | step ms | step vs bare: median (range, {args.rounds} rounds) "
        "| epoch end ms |"
    )
    print("| --- | --- | --- | --- |")
    for name in CONFIGS:
        ratio = np.array(step_ms[name]) / bare
        print(
            f"| {name} | {np.median(step_ms[name]):.2f} | {np.median(ratio):.3f}x "
            f"({ratio.min():.3f}-{ratio.max():.3f}) | {np.median(epoch_end_ms[name]):.1f} |"
        )
    _plain_loop(args.steps)


if __name__ == "__main__":
    main()
