"""MLflow on a local store: the gradient-flow chart and heatmaps as figures, the alarms as text,
every per-layer value as a metric at its optimizer step.

Run: ``python examples/mlflow_local.py``, then
``mlflow ui --backend-store-uri sqlite:///mlflow.db`` and open the run's artifacts.
"""

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import MLFlowLogger
from quickstart import Regressor  # the quickstart's model: only the logger differs
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import ActivationStatsCallback, GradFlowCallback

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
