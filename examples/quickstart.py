"""Quick start: add the callback to any Trainer, then open TensorBoard.

Run: ``python examples/quickstart.py``, then ``tensorboard --logdir runs``.
"""

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import GradFlowCallback


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
        )

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    x = torch.randn(512, 16)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32, shuffle=True)
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=TensorBoardLogger("runs", name="quickstart"),
        callbacks=[GradFlowCallback()],  # hooks on every layer, removed when fit ends
        enable_checkpointing=False,
    )
    trainer.fit(Regressor(), data)
    print(f"logs in {trainer.log_dir}; view them with: tensorboard --logdir runs")
