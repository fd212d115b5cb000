"""One long epoch from an ``IterableDataset`` with ``max_steps``: statistics while it trains.

An LLM-style run has one epoch (or none: a stream and ``max_steps``). The callbacks write their
statistics at the Trainer's logging cadence, the same steps as the user's own ``self.log``
(``log_every_n_steps``, 50 by default: steps 49, 99, ...; and the epoch's first step), under
``..._step`` tags, and save the event file there as Lightning does: a run that dies keeps them.
The epoch end adds the aggregates, the chart and the alarm summary.

Run: ``python examples/long_epoch.py``, then ``tensorboard --logdir runs``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from lightning_hooks import ActivationStatsCallback, DeadReLUCallback, GradFlowCallback


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """An endless stream of batches of a noisy linear target: no length, no epochs."""

    def __init__(self, features: int = 16, batch: int = 32, seed: int = 0) -> None:
        self.features, self.batch, self.seed = features, batch, seed

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed)
        weight = torch.randn(self.features, 1, generator=g)
        while True:
            x = torch.randn(self.batch, self.features, generator=g)
            yield x, x @ weight + 0.1 * torch.randn(self.batch, 1, generator=g)


class Regressor(pl.LightningModule):
    def __init__(self, features: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
        )

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main(max_steps: int = 300, log_every_n_steps: int = 50, root: str = "runs") -> pl.Trainer:
    """Train ``max_steps`` steps of one endless epoch with the three default callbacks."""
    trainer = pl.Trainer(
        max_steps=max_steps,
        log_every_n_steps=log_every_n_steps,
        accelerator="cpu",
        logger=TensorBoardLogger(root, name="long_epoch"),
        callbacks=[GradFlowCallback(), ActivationStatsCallback(), DeadReLUCallback()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), DataLoader(Stream(), batch_size=None))
    return trainer


if __name__ == "__main__":
    main()
    print("tensorboard --logdir runs")
