"""A checkpoint saved mid-epoch by a ``GradFlowCallback`` of a released version, and the fit that
makes it. ``tests/data/grad_flow_0.2.0.ckpt`` was made by release 0.2.0 (its source checked
out at ``/tmp/v020``), the release's package first on the path (an editable install of this
checkout would otherwise win)::

    cd /tmp/v020 && python -c "import runpy, sys; sys.path.insert(0, '.'); \\
        sys.argv[1:] = ['out.ckpt']; \\
        runpy.run_path('tests/release_checkpoint.py', run_name='__main__')"

with this file copied into that checkout. The tests resume from it with this version and compare
with a fit that was never interrupted.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import GradFlowCallback

SAVED_AT = 2
"""The optimizer step the checkpoint was saved after, of an epoch of 4."""


class SameBatchesMLP(pl.LightningModule):
    """8 -> 16 -> 16 -> 1; 4 batches per epoch, each the same 8 samples, so that the batches a
    resumed fit replays are the ones the interrupted fit would have seen."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0)).repeat(4, 1)
        return DataLoader(TensorDataset(x, x[:, :1]), batch_size=8)


def trainer(root: Path, **kwargs: Any) -> pl.Trainer:
    """The Trainer of both fits: CPU, TensorBoard under ``root``, a logging step every step."""
    return pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=pl.loggers.TensorBoardLogger(str(root), name="tb", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        **kwargs,
    )


def save(path: Path) -> None:
    """Fit with ``GradFlowCallback()`` and keep the checkpoint saved after step ``SAVED_AT``."""
    with tempfile.TemporaryDirectory() as root:
        every = ModelCheckpoint(dirpath=root, every_n_train_steps=SAVED_AT, save_top_k=-1)
        fit = trainer(Path(root), callbacks=[GradFlowCallback(), every])
        fit.fit(SameBatchesMLP())
        saved = next(Path(root).glob(f"*step={SAVED_AT}.ckpt"))
        path.write_bytes(saved.read_bytes())


if __name__ == "__main__":
    save(Path(sys.argv[1]))
