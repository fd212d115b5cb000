"""The callbacks under DDP: two CPU processes (gloo), statistics reduced across ranks at epoch end.

Run: ``python examples/ddp.py``. Rank 0 writes the logs under ``runs/ddp``.
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
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)
    logger = TensorBoardLogger("runs", name="ddp")
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=2,
        strategy="ddp",  # each rank trains on half of every epoch (DistributedSampler)
        logger=logger,
        callbacks=[GradFlowCallback()],
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(Regressor(), data)
    if trainer.is_global_zero:  # trainer.log_dir is a collective: not from one rank only
        print(f"logs in {logger.log_dir}; view them with: tensorboard --logdir runs")


if __name__ == "__main__":
    main()
