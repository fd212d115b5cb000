"""A 2-process CPU DDP fit (gloo) with GradFlowCallback, run as a script by test_distributed.py.

Lightning's DDP launcher re-runs this script for rank 1, so everything happens under ``main()``.
Fits in one launch: 10 layers logged to TensorBoard, 200 layers to a CSVLogger (the chart as PNG
files beside its metrics.csv), 10 layers with gradient accumulation and
clipping; then the loss rules: rank 1's loss jumps by ``OFFSET`` from optimizer step ``JUMP`` on
(rank 0's does not), under the default ``on_alarm`` and then ``{"diverging": "raise"}`` (last:
the error ends that fit on both ranks), and a manual-optimization fit whose rank 1 returns no
loss. Every ``torch.distributed`` collective is counted per batch and per epoch (all of them, and
those made from the ``lightning_hooks`` package); each rank writes ``rank{r}.json`` into
``--out``. Each rank gets half of each global batch of 8 (a
``DistributedSampler`` without shuffling: rank ``r`` takes samples ``r, r + 2, ...``), so
``fit(..., devices=1)`` sees the same global batches in one process.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from collectives import CollectiveCounter, LossReading
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SAMPLES = 32
ACCUMULATE_CLIP: dict[str, Any] = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}
JUMP = 5  # the optimizer step from which rank 1's loss is OFFSET higher
OFFSET = 20.0  # a constant: the gradients, and so the training, do not change


def regression_loader(batch_size: int) -> DataLoader[Any]:
    """``SAMPLES`` fixed regression pairs, split over the ranks in order (no shuffling)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=g)
    y = x[:, :1] - 0.5 * x[:, 1:2]
    data = TensorDataset(x, y)
    # Lightning's own DistributedSampler would shuffle: split without shuffling instead.
    sampler = DistributedSampler(data, shuffle=False) if dist.is_initialized() else None
    return DataLoader(data, batch_size=batch_size, sampler=sampler)


class DeepMLP(pl.LightningModule):
    """``depth`` Linear(8, 8) + Tanh blocks and a Linear(8, 1) head, MSE (mean) loss."""

    def __init__(self, depth: int = 10, batch_size: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks: list[nn.Module] = []
        for _ in range(depth):
            blocks += [nn.Linear(8, 8), nn.Tanh()]
        self.net = nn.Sequential(*blocks, nn.Linear(8, 1))
        self.batch_size = batch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        return regression_loader(self.batch_size)


class JumpingLoss(DeepMLP):
    """``DeepMLP(10)`` whose rank 1 adds ``OFFSET`` to its loss from step ``JUMP`` on; every
    rank records the loss it returns at each optimizer step (``losses``)."""

    def __init__(self) -> None:
        super().__init__(depth=10, batch_size=SAMPLES // 4 // 2)
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if dist.get_rank() == 1 and self.trainer.global_step >= JUMP:
            loss = loss + OFFSET
        self.losses[self.trainer.global_step] = loss.item()
        return loss


class ManualSkip(DeepMLP):
    """``DeepMLP(10)`` under manual optimization: rank 0 returns its loss, rank 1 nothing."""

    def __init__(self) -> None:
        super().__init__(depth=10, batch_size=SAMPLES // 4 // 2)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:  # type: ignore[override]
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        optimizer.zero_grad()  # type: ignore[union-attr]
        self.manual_backward(loss)
        optimizer.step()  # type: ignore[union-attr]
        return loss if dist.get_rank() == 0 else None


class AlarmLog(pl.Callback):
    """Each epoch's alarms as ``GradFlowCallback`` holds them after the batch (put it after)."""

    def __init__(self, watched: Any) -> None:
        self.watched = watched
        self.epochs: dict[int, list[tuple[str, int, float]]] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        alarms = self.watched._fit.alarms.training_alarms
        self.epochs[trainer.current_epoch] = [(a.rule, a.step, a.value) for a in alarms.log]


def loss_fit(root: Path, model: DeepMLP, on_alarm: Any = "warn") -> dict[str, Any]:
    """A 2-process fit of ``model`` with ``GradFlowCallback(on_alarm=on_alarm)``: each epoch's
    alarms, the losses, the collectives per batch, the warnings and the error on this rank."""
    from lightning_hooks import GradFlowCallback
    from lightning_hooks.errors import LightningHooksWarning, TrainingAlarmError

    grad_flow = GradFlowCallback(on_alarm=on_alarm, chart=False)
    log, counter = AlarmLog(grad_flow), CollectiveCounter()
    reading = LossReading(grad_flow)
    trainer = pl.Trainer(
        devices=2,
        strategy="ddp",
        callbacks=[grad_flow, log, counter, reading],
        **trainer_options(root, "tensorboard"),
    )
    report: dict[str, Any] = {"error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model)
        except TrainingAlarmError as err:
            report["error"] = {"rule": err.rule, "step": err.step, "value": err.value}
        finally:
            counter.restore()
    report["warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, LightningHooksWarning)
    ]
    report["alarms"] = log.epochs
    report["losses"] = getattr(model, "losses", {})
    report["steps"] = counter.steps
    report["global_step"] = trainer.global_step
    report["loss_reading"] = reading.reading
    return report


def trainer_options(root: Path, logger: str) -> dict[str, Any]:
    """The Trainer options both the DDP and the single-process run use."""
    loggers = {
        "tensorboard": TensorBoardLogger(str(root), name="tb", version=0),
        "csv": CSVLogger(str(root), name="csv", version=0),
    }
    return {
        "max_epochs": 2,
        "accelerator": "cpu",
        "logger": loggers[logger],
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,  # the callbacks' default cadence: every step is compared
        "use_distributed_sampler": False,
    }


def fit(root: Path, depth: int, logger: str, devices: int, **extra: Any) -> CollectiveCounter:
    """One fit of ``DeepMLP(depth)`` with GradFlowCallback; logs under ``root``."""
    from lightning_hooks import GradFlowCallback

    counter = CollectiveCounter()
    strategy = {"strategy": "ddp"} if devices > 1 else {}
    trainer = pl.Trainer(
        devices=devices,
        callbacks=[GradFlowCallback(), counter],
        **strategy,
        **trainer_options(root, logger),
        **extra,
    )
    trainer.fit(DeepMLP(depth=depth, batch_size=SAMPLES // 4 // devices))
    counter.restore()
    return counter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report: dict[str, Any] = {}
    # The second fit reuses the process group: Lightning does not launch again.
    for depth, logger in ((10, "tensorboard"), (200, "csv")):
        counter = fit(args.out / f"depth{depth}", depth, logger, devices=2)
        report[f"depth{depth}"] = {"epochs": counter.epochs, "ours": dict(counter.ours)}
    counter = fit(args.out / "accumulate_clip", 10, "tensorboard", devices=2, **ACCUMULATE_CLIP)
    report["accumulate_clip"] = {"steps": counter.steps}
    report["warn"] = loss_fit(args.out / "warn", JumpingLoss())
    report["manual"] = loss_fit(args.out / "manual", ManualSkip())
    report["raise"] = loss_fit(args.out / "raise", JumpingLoss(), {"diverging": "raise"})
    report["rank"] = dist.get_rank()
    report["world_size"] = dist.get_world_size()
    report["backend"] = dist.get_backend()
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))


def exit_cleanly() -> None:
    """End a script whose work is done: destroy the process group, run the exit handlers, flush
    the streams, and leave with ``os._exit(0)``, without the interpreter's finalization.

    Lightning leaves the process group alive after ``fit``. Gloo's threads, and torch's C++
    objects that outlive the group (its store), can abort a process at finalization whose fits
    all succeeded (SIGABRT, "terminate called without an active exception"), more often on a
    loaded machine, even with the group destroyed first. Everything the tests read is written
    by then, and the exit handlers (the loggers' writers) run here.
    A script whose ``main()`` raises never gets here: it still exits non-zero.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    atexit._run_exitfuncs()  # the interpreter's exit handlers, which os._exit skips
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_cleanly()
