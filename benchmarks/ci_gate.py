"""The CI gate the README recommends, on healthy noisy runs and on broken ones, through
``Trainer.fit`` and ``lightning-hooks report``.

The healthy runs: an MLP on scikit-learn's ``load_breast_cancer``, ``load_digits`` and
``load_wine`` (standardised features), micro-batches of 2 with ``accumulate_grad_batches=4``,
AdamW at 3e-4, seeds 0-2, 800 to 900 optimizer steps each, and the breast-cancer runs again at
1e-3 and 3e-3, with ``GradFlowCallback()`` and ``DeadReLUCallback()`` at their defaults: losses
that swing from one micro-batch to the next, runs that learn. A healthy run with one optimizer
step whose loss reads 10x; the broken runs: one NaN loss, and AdamW at a learning rate 1,000x
too high.

Each run logs under its own folder, and the gate is run on each folder alone; the exit code
per run is printed as JSON, with the text of every alarm warning the fit raised (the gate's
``FAIL`` lines go to standard error).

Usage::

    PYTHONPATH=$PWD python benchmarks/ci_gate.py --out /tmp/gate \\
        --gate 'grad_nonfinite>0' --gate 'dead_fraction>=0.9' --gate 'warnings>0'
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import DeadReLUCallback, GradFlowCallback
from lightning_hooks.cli import main as report
from lightning_hooks.errors import TrainingAlarmWarning

EPOCHS = {"breast_cancer": 12, "digits": 4, "wine": 36}
"""Epochs per data set: 800 to 900 optimizer steps of 2 x 4 examples each."""


def _data(name: str) -> TensorDataset:
    """A scikit-learn data set that ships with the package, its features standardised."""
    from sklearn import datasets

    loaded = getattr(datasets, f"load_{name}")()
    x = torch.tensor(loaded.data, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-6)
    return TensorDataset(x, torch.tensor(loaded.target, dtype=torch.long))


class Classifier(pl.LightningModule):
    """A two-hidden-layer MLP on AdamW; ``factor(batch_idx)`` scales the loss it returns (the
    difference a constant: the gradient is the true loss's), NaN included."""

    def __init__(
        self, data: TensorDataset, lr: float, seed: int, factor: Callable[[int], float]
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        features = data.tensors[0].shape[1]
        classes = int(data.tensors[1].max()) + 1
        self.net = nn.Sequential(
            nn.Linear(features, 64),
            nn.ReLU(),
            nn.Linear(64, 64),
            nn.ReLU(),
            nn.Linear(64, classes),
        )
        self.data = data
        self.lr = lr
        self.seed = seed
        self.factor = factor

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        scale = self.factor(self.global_step * 10_000 + batch_idx)
        return loss + (scale - 1.0) * loss.detach()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self) -> DataLoader[Any]:
        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.data, batch_size=2, shuffle=True, generator=gen)


def _at(step: int, value: float) -> Callable[[int], float]:
    """A factor of ``value`` on the micro-batches of optimizer step ``step``, else 1."""
    return lambda key: value if key // 10_000 == step else 1.0


RUNS: dict[str, tuple[str, float, int, Callable[[int], float]]] = {
    **{
        f"healthy-{name}-seed{seed}": (name, 3e-4, seed, lambda key: 1.0)
        for name in EPOCHS
        for seed in (0, 1, 2)
    },
    **{
        f"healthy-breast_cancer-lr{lr:g}-seed{seed}": ("breast_cancer", lr, seed, lambda key: 1.0)
        for lr in (1e-3, 3e-3)
        for seed in (0, 1, 2)
    },
    "healthy-breast_cancer-seed0-one-batch-10x": ("breast_cancer", 3e-4, 0, _at(200, 10.0)),
    "broken-breast_cancer-nan-at-step-200": ("breast_cancer", 3e-4, 0, _at(200, math.nan)),
    "broken-digits-lr-0.3": ("digits", 0.3, 0, lambda key: 1.0),
}
"""Each run: data set, learning rate, seed, the factor on its returned loss."""


def fit(name: str, out: Path) -> list[str]:
    """Fit one run of :data:`RUNS` under ``out/name``: its alarm warnings' text."""
    data, lr, seed, factor = RUNS[name]
    pl.seed_everything(seed, verbose=False)
    trainer = pl.Trainer(
        max_epochs=EPOCHS[data],
        accumulate_grad_batches=4,
        accelerator="cpu",
        devices=1,
        logger=TensorBoardLogger(str(out / name), name="tb", version=0),
        callbacks=[GradFlowCallback(), DeadReLUCallback()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(Classifier(_data(data), lr, seed, factor))
    return [str(w.message) for w in record if issubclass(w.category, TrainingAlarmWarning)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="a folder for the runs' logs")
    parser.add_argument("--gate", action="append", default=[], help="a --fail-on rule")
    parser.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--skip-fit", action="store_true", help="gate the runs already in --out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.runs:
        warned = [] if args.skip_fit else fit(name, args.out)
        rules = [arg for rule in args.gate for arg in ("--fail-on", rule)]
        with contextlib.redirect_stdout(io.StringIO()):  # the tables: stdout holds the JSON only
            code = report(["report", str(args.out / name), *rules])
        rows.append({"run": name, "exit": code, "warnings": warned})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
