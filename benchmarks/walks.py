"""The walk of a logged value through the library's files, recorded, not drawn by hand.

One fit of a small MLP with ``GradFlowCallback()`` at its defaults. ``sys.setprofile`` records
every call into a module of ``lightning_hooks`` during one logging step (from its first batch's
start to the end of the batch after it, when its values are written), and during the optimizer
step at which a ``diverging`` alarm is warned (the loss made to jump at a fixed step, so the walk
does not depend on the run's floating-point path). Each walk prints the files in the order the
calls entered them, a file again where the walk came back to it, and counts the files and the
returns::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/walks.py
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_hooks

PACKAGE = Path(lightning_hooks.__file__).resolve().parent
LOGGING_STEP = 4  # log_every_n_steps=5: steps 0, 4, 9, ... are logging steps
JUMP = 12  # the step from which the loss is multiplied: *diverging* is warned soon after


class Recorder(pl.Callback):
    """First in the list: records our calls between two optimizer steps."""

    def __init__(self, first: int, last: int) -> None:
        self.first = first
        self.last = last
        self.files: list[str] = []

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        path = Path(frame.f_code.co_filename).resolve()
        if PACKAGE in path.parents:
            name = path.relative_to(PACKAGE.parent).as_posix()
            if not self.files or self.files[-1] != name:
                self.files.append(name)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.first:
            sys.setprofile(self._profile)
        elif trainer.global_step == self.last + 1:
            sys.setprofile(None)


class Jumping(pl.LightningModule):
    """An MLP on fixed random data whose loss is multiplied by 50 from step ``JUMP`` on."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        return loss * 50.0 if self.trainer.global_step >= JUMP else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1)), 8)


def walk(first: int, last: int) -> list[str]:
    """The files our calls entered from step ``first`` to the end of step ``last``."""
    recorder = Recorder(first, last)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = pl.Trainer(
            max_epochs=1,
            accelerator="cpu",
            logger=TensorBoardLogger(tmp, name="tb"),
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            log_every_n_steps=LOGGING_STEP + 1,
            callbacks=[recorder, lightning_hooks.GradFlowCallback()],
        )
        trainer.fit(Jumping())
    return recorder.files


def report(title: str, files: list[str]) -> None:
    distinct = list(dict.fromkeys(files))
    print(f"## {title}\n")
    print(f"{len(distinct)} files, {len(files) - len(distinct)} returns to a file left before:\n")
    for name in files:
        print(f"- {name}")
    print()


def main() -> None:
    torch.set_num_threads(1)
    report(
        f"grad_flow/grad_norm/<layer>: logging step {LOGGING_STEP}, measured and written",
        walk(LOGGING_STEP, LOGGING_STEP + 1),
    )
    report(f"diverging: the loss from step {JUMP} on, to the warning", walk(JUMP, JUMP + 6))


if __name__ == "__main__":
    main()
