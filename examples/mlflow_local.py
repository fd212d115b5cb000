"""MLflow on a local store: the gradient-flow chart and heatmaps as figures, the alarms as text,
every per-layer value as a metric at its optimizer step.

Run: ``python examples/mlflow_local.py``, then
``mlflow ui --backend-store-uri sqlite:///mlflow.db`` and open the run's artifacts.
"""

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import MLFlowLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import ActivationStatsCallback, GradFlowCallback


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
    # MLflow 3's plain file store (./mlruns) is in maintenance mode: a sqlite store is local too.
    logger = MLFlowLogger(
        experiment_name="lightning_hooks",
        tracking_uri="sqlite:///mlflow.db",
        artifact_location="mlartifacts",
    )
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=logger,
        callbacks=[GradFlowCallback(heatmap=True), ActivationStatsCallback()],
        enable_checkpointing=False,
    )
    trainer.fit(Regressor(), data)
    print(
        f"MLflow run {logger.run_id}; view it with: "
        "mlflow ui --backend-store-uri sqlite:///mlflow.db"
    )
