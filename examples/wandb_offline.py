"""Weights & Biases, offline: the gradient-flow chart, heatmaps, histograms and the alarms' table
in a W&B run, with no account and no network.

Run: ``python examples/wandb_offline.py``, then ``wandb sync wandb/offline-run-*`` to upload it
(or open ``wandb/offline-run-*/files/media`` to see the pictures).
"""

import os

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import WandbLogger
from quickstart import Regressor  # the quickstart's model: only the logger differs
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import ActivationStatsCallback, GradFlowCallback

if __name__ == "__main__":
    import wandb

    os.environ.setdefault("WANDB_MODE", "offline")
    x = torch.randn(512, 16)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32, shuffle=True)
    logger = WandbLogger(project="lightning_hooks", save_dir=".", offline=True)
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=logger,
        # Every picture goes to W&B: charts and heatmaps as images, histograms as
        # wandb.Histogram, the alarms as a table; every value at trainer/global_step.
        callbacks=[GradFlowCallback(histograms=True, heatmap=True), ActivationStatsCallback()],
        enable_checkpointing=False,
    )
    trainer.fit(Regressor(), data)
    run_dir = os.path.dirname(logger.experiment.dir)
    wandb.finish()
    print(f"W&B run in {run_dir}; upload it with: wandb sync {run_dir}")
