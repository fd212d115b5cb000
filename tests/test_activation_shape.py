"""Kurtosis and the outlier ratio through a real ``Trainer.fit``, against float64 references of
the very outputs, read back from the TensorBoard events: ordinary activations, a layer whose
mean is about 90 of its standard deviations from 0, massive activations (a few entries 1e3-1e4
times the RMS of the others), one output at a time, a batch per shape and an output in pieces,
in float32 and under bf16 autocast."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hooks import ActivationStatsCallback
from lightning_hooks.core.stats import activation_shape
from lightning_hooks.core.stats.activation_shape import power_sums

from conftest import dataset, epoch_end_step, read_scalars

WIDTH, BATCH = 64, 16
RTOL = 1e-3


class Massive(nn.Module):
    """Scales its ``[BATCH, WIDTH]`` input, then puts three of its entries far out: 3e3, -5e3
    and 1e4 (the others have an RMS of about 1, from a LayerNorm)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(WIDTH))
        spikes = torch.zeros(BATCH, WIDTH)
        spikes[[0, 5, 11], [3, 17, 40]] = torch.tensor([3e3, -5e3, 1e4])
        self.register_buffer("spikes", spikes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain + self.spikes


class Recording(pl.LightningModule):
    """Keeps a copy of every layer output of training forwards, as the layer returned it."""

    def __init__(self) -> None:
        super().__init__()
        shifted = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            shifted.bias.fill_(50.0)  # its outputs: a mean about 90 times their spread
        self.net = nn.Sequential(
            nn.Linear(8, WIDTH), nn.LayerNorm(WIDTH), shifted, nn.LayerNorm(WIDTH), Massive(),
            nn.ReLU(), nn.Linear(WIDTH, 1),
        )  # fmt: skip
        self.outputs: dict[str, list[torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, module in enumerate(self.net):
            x = module(x)
            if self.training and torch.is_grad_enabled():
                self.outputs.setdefault(f"net.{i}", []).append(x.detach().clone())
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-7)  # the spikes keep the loss large

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(4 * BATCH), batch_size=BATCH)


def _reference(outputs: list[torch.Tensor]) -> dict[str, float]:
    x = torch.cat([o.flatten() for o in outputs]).double()
    centred = x - x.mean()
    return {
        "kurtosis": float((centred**4).mean() / (centred**2).mean() ** 2),
        "outlier_ratio": float(x.abs().max() / x.square().mean().sqrt()),
    }


def worst_relative_error(model: Recording, scalars: dict[str, list[tuple[int, float]]]) -> float:
    """The largest relative error of the logged kurtosis and outlier ratios, every logging step
    and the epoch, against :func:`_reference`."""
    worst = 0.0
    for layer, outputs in model.outputs.items():
        windows = [("{stat}_step", step, outputs[step : step + 1]) for step in range(4)]
        windows.append(("{stat}", epoch_end_step(4), outputs))
        for name, step, window in windows:
            for stat, want in _reference(window).items():
                logged = dict(scalars[f"activations/{name.format(stat=stat)}/{layer}"])[step]
                worst = max(worst, abs(logged - want) / abs(want))
    return worst


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("measured", ["a batch per shape", "one at a time", "in pieces"])
def test_kurtosis_and_outlier_ratio_equal_float64_references(
    precision: str,
    measured: str,
    trainer_factory: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if measured != "a batch per shape":
        monkeypatch.setattr(activation_shape, "STACKED", 0)
    if measured == "in pieces":  # a large output's way: 10 pieces of 100 entries, and one of 24
        monkeypatch.setattr(activation_shape, "CHUNK", 100)
    model = Recording()
    trainer_factory(callbacks=[ActivationStatsCallback(heatmaps=False)], precision=precision).fit(
        model
    )
    scalars = read_scalars(tmp_path)
    assert sorted(model.outputs) == [f"net.{i}" for i in range(7)]
    if precision == "bf16-mixed":  # autocast's own: the Linear layers' outputs are bf16
        assert model.outputs["net.0"][0].dtype == torch.bfloat16
    massive = _reference(model.outputs["net.4"])
    assert massive["outlier_ratio"] > 25 and massive["kurtosis"] > 500  # at most 32 and 1024
    assert worst_relative_error(model, scalars) < RTOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    ("scale", "shift"),
    [(1.0, 0.0), (3.0, 1.0), (1.0, 100.0), (1e-20, 0.0), (1e15, 0.0)],
)
def test_power_sums_give_float64_central_moments(
    dtype: torch.dtype, scale: float, shift: float
) -> None:
    """The central moments from the float32 sums, about 0 again in float64, are the float64
    ones of the same values: no overflow at 1e15, no underflow at 1e-20, a mean 100 times the
    spread; and three entries 1e3-1e4 times the RMS in one row."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 1000, generator=g) * scale + shift).to(dtype)
    x[0, :3] = torch.tensor([3e3, -5e3, 1e4]).to(dtype) * scale + shift
    sums, peak = power_sums(x)
    n, s1, s2, s3, s4 = sums.T.numpy()
    mu = s1 / n
    variance = s2 / n - mu * mu
    central4 = s4 / n - 4 * mu * s3 / n + 6 * mu * mu * s2 / n - 3 * mu**4
    d = x.double()
    centred = d - d.mean(1, keepdim=True)
    want = ((centred**4).mean(1) / (centred**2).mean(1) ** 2).numpy()
    np.testing.assert_allclose(central4 / variance**2, want, rtol=1e-5)
    np.testing.assert_array_equal(peak.numpy(), x.abs().amax(1).float().numpy())
