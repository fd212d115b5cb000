"""Statistics of your own in a few lines: the RMS of each layer's output, and the largest
absolute weight of each layer, logged per epoch.

``OutputRMS`` declares two device states (summed across ranks), measures each training output
in a forward hook and says which tags its result gives; ``WeightPeak`` reads the layer's
weight instead of its output. ``StatsCallback`` does the rest: selection, the logging steps,
one collective per epoch under DDP, logging, checkpoints.

Run: ``python examples/custom_stat.py``, then ``tensorboard --logdir runs``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_hooks import LayerStat, Selection


class OutputRMS(LayerStat[dict[str, float]]):
    """Root mean square of every selected layer's training outputs, over the epoch."""

    sum_sq: torch.Tensor
    numel: torch.Tensor

    def __init__(self, types: type[nn.Module] | tuple[type[nn.Module], ...] = nn.Linear) -> None:
        super().__init__(Selection.of("OutputRMS", types=types))
        self.add_layer_state("sum_sq", reduce="sum")
        self.add_layer_state("numel", reduce="sum")

    def observe(self, name: str, module: nn.Module, output: Any) -> None:
        row = self.row(name)
        self.sum_sq[row] += output.detach().float().square().sum()
        self.numel[row] += output.numel()

    def summarize(self, states: dict[str, np.ndarray]) -> dict[str, float]:
        rms = np.sqrt(states["sum_sq"] / np.maximum(states["numel"], 1))
        return dict(zip(self.layers, rms.tolist(), strict=True))

    def tags(self, result: dict[str, float]) -> dict[str, float]:
        return {f"output_rms/{layer}": value for layer, value in result.items()}


class WeightPeak(LayerStat[dict[str, float]]):
    """The largest |w| of every selected layer's weight, over the epoch's logging steps."""

    peak: torch.Tensor

    def __init__(self, types: type[nn.Module] | tuple[type[nn.Module], ...] = nn.Linear) -> None:
        super().__init__(Selection.of("WeightPeak", types=types))
        self.add_layer_state("peak", reduce="max", fill=0.0)

    def observe(self, name: str, module: nn.Module, output: Any) -> None:
        row = self.row(name)
        peak = module.weight.detach().abs().max()
        self.peak[row] = torch.maximum(self.peak[row], peak)

    def summarize(self, states: dict[str, np.ndarray]) -> dict[str, float]:
        return dict(zip(self.layers, states["peak"].tolist(), strict=True))

    def tags(self, result: dict[str, float]) -> dict[str, float]:
        return {f"weights/peak/{layer}": value for layer, value in result.items()}


def main() -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import TensorBoardLogger
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hooks import StatsCallback

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self) -> DataLoader[Any]:
            x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(x, x[:, :1]), batch_size=32)

    trainer = pl.Trainer(
        max_epochs=3,
        logger=TensorBoardLogger("runs", name="custom_stat"),
        callbacks=[StatsCallback([OutputRMS(), WeightPeak()], every_n_steps=1)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Model())
    print("tensorboard --logdir runs")


if __name__ == "__main__":
    main()
