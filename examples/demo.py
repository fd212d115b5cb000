"""The demo: a small CNN learns the handwritten digits that ship with scikit-learn (offline),
with GradFlowCallback, and writes TensorBoard logs under ./runs.

Run it with ``./dev demo`` (which sets everything up) or ``python examples/demo.py``.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

from lightning_hooks import GradFlowCallback


class DigitsCNN(pl.LightningModule):
    """conv + BatchNorm + ReLU blocks on the 8x8 digits, then a linear classifier."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/acc", (self(x).argmax(1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def digits_loaders(batch_size: int = 64) -> tuple[DataLoader[Any], DataLoader[Any]]:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    train, val = random_split(TensorDataset(x, y), [0.8, 0.2], torch.Generator().manual_seed(0))
    return DataLoader(train, batch_size, shuffle=True), DataLoader(val, batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--logdir", default="runs", help="TensorBoard log directory")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    pl.seed_everything(0, verbose=False)
    logger = TensorBoardLogger(args.logdir, name="digits_cnn")
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        accelerator="cpu",
        logger=logger,
        callbacks=[GradFlowCallback()],
        enable_checkpointing=False,
        enable_model_summary=False,
        log_every_n_steps=5,
    )
    train, val = digits_loaders()
    trainer.fit(DigitsCNN(), train, val)
    logdir = Path(logger.log_dir).resolve()
    print(f"\nTensorBoard logs written to {logdir}")
    print("  gradient-flow scalars: grad_flow/*, chart image: grad_flow/chart")
    print(f"\nView them with:\n  tensorboard --logdir {args.logdir}")


if __name__ == "__main__":
    main()
