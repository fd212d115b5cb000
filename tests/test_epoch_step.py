"""Every epoch value of the library lands at the step of Lightning's own epoch metrics.

Real fits with a ``TensorBoardLogger`` log a training metric ``on_epoch=True`` and a validation
metric; the event files are read back, and every epoch tag, picture, histogram and text of the
library is at exactly the steps Lightning wrote its two metrics at: under gradient accumulation,
at a cadence whose last logging step is not the epoch's last step, and under a manual
optimization of two optimizer steps a batch, where ``trainer.global_step`` counts two a batch
and Lightning's step one. The alarms' texts of a logging step and of an epoch never share a tag
and a step, nor do two epochs' summaries where an epoch in which no batch stepped repeats the
step of the epoch before it.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from torch import nn
from torch.utils.data import DataLoader

from lightning_hooks import (
    ActivationStatsCallback,
    AlarmRules,
    FeatureMapCallback,
    GradFlowCallback,
    LayerTimeCallback,
)
from lightning_hooks.tags import ALARM_STEP_TEXT, ALARM_TEXT, LIBRARY_FAMILIES, epoch_tag

from conftest import _accumulators, dataset, make_trainer

BATCHES = 7
"""Batches per epoch: odd, so that under an accumulation of 2 the epoch's last optimizer step
is its last batch alone."""
EPOCHS = 2
LIGHTNING = ("train/loss", "val/acc")
"""Lightning's own epoch metrics: the training loss ``on_epoch=True`` and a validation metric."""


class Logs(pl.LightningModule):
    """A small MLP that logs its loss per epoch and a validation metric, as users do."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train/loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/acc", (self(x).sign() == y.sign()).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(n=8 * BATCHES), batch_size=8)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(n=16, seed=1), batch_size=8)


class TwoSteps(Logs):
    """Manual optimization with two optimizer steps a batch (as a GAN's two players)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        for optimizer in self.optimizers():  # type: ignore[union-attr]
            loss = nn.functional.mse_loss(self(x), y)
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
        self.log("train/loss", loss, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> list[torch.optim.Optimizer]:  # type: ignore[override]
        first = torch.optim.SGD(self.net[0].parameters(), lr=0.05)
        return [first, torch.optim.SGD(self.net[2].parameters(), lr=0.05)]


def _events(log_dir: Path) -> list[tuple[str, int, str]]:
    """Every summary value written under ``log_dir``: ``(tag, step, plugin)``, duplicates kept."""
    found = []
    for path in sorted(log_dir.rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                plugin = value.metadata.plugin_data.plugin_name or value.WhichOneof("value")
                found.append((value.tag, event.step, plugin))
    return found


def _lightning_steps(log_dir: Path) -> list[int]:
    """The steps of Lightning's own epoch metrics, which agree with each other."""
    scalars = {
        tag: [e.step for e in acc.Scalars(tag)]
        for acc in _accumulators(log_dir)
        for tag in acc.Tags()["scalars"]
        if tag in LIGHTNING
    }
    assert set(scalars) == set(LIGHTNING), scalars
    assert scalars["train/loss"] == scalars["val/acc"], scalars
    return scalars["val/acc"]


def _library_epoch_steps(log_dir: Path) -> dict[str, list[int]]:
    """The steps of every epoch value of the library: its scalars, pictures and texts."""
    steps: dict[str, list[int]] = {}
    for tag, step, plugin in _events(log_dir):
        if tag.split("/")[0] not in LIBRARY_FAMILIES:
            continue  # Lightning's own, the dashboard's layout
        if tag == f"{ALARM_STEP_TEXT}/text_summary" or epoch_tag(tag) is not None:
            continue  # a logging step's
        steps.setdefault(f"{tag} ({plugin})", []).append(step)
    return steps


def _fit(tmp_path: Path, model: pl.LightningModule, **options: Any) -> pl.Trainer:
    """Fit ``model`` for :data:`EPOCHS` epochs under every callback that writes at epoch ends."""
    callbacks = [
        GradFlowCallback(heatmap=True, histograms=True),
        ActivationStatsCallback(histograms=True),
        LayerTimeCallback(),
        FeatureMapCallback(layers=["net.0"]),
    ]
    trainer = make_trainer(
        tmp_path,
        callbacks=callbacks,
        max_epochs=EPOCHS,
        num_sanity_val_steps=0,
        **options,
    )
    trainer.fit(model)
    return trainer


@pytest.mark.parametrize(
    ("accumulate", "log_every_n_steps"),
    [(1, 1), (1, 4), (2, 2)],
    ids=["every-step", "cadence-4", "accumulate-2"],
)
def test_epoch_values_land_at_lightnings_epoch_step(
    tmp_path: Path, accumulate: int, log_every_n_steps: int
) -> None:
    _fit(
        tmp_path,
        Logs(),
        accumulate_grad_batches=accumulate,
        log_every_n_steps=log_every_n_steps,
        limit_val_batches=2,
    )
    lightning = _lightning_steps(tmp_path)
    # Lightning's step: each epoch's last batch that stepped, one step per accumulated batch
    stepped = math.ceil(BATCHES / accumulate)
    assert lightning == [stepped * (epoch + 1) - 1 for epoch in range(EPOCHS)]
    library = _library_epoch_steps(tmp_path)
    expected = {
        "grad_flow/grad_norm/net.0 (scalars)",
        "grad_flow/alarms/spike_score (scalars)",
        "grad_flow/chart (images)",
        "grad_flow/heatmap (images)",
        "grad_flow/grad_log10_abs/net.0 (histograms)",
        f"{ALARM_TEXT}/text_summary (text)",
        "activations/mean/net.0 (scalars)",
        "activations/heatmap/mean (images)",
        "activations/histogram/net.0 (histograms)",
        "layer_time/chart (images)",
        "feature_map/abs_mean/net.0 (scalars)",
    }
    assert expected <= set(library), sorted(library)
    wrong = {tag: steps for tag, steps in library.items() if steps != lightning}
    assert not wrong, f"Lightning's epoch metrics at {lightning}; the library's: {wrong}"


def test_two_optimizer_steps_a_batch_keep_lightnings_epoch_step(tmp_path: Path) -> None:
    """``trainer.global_step`` counts both optimizers' steps; Lightning's step counts batches."""
    callback = GradFlowCallback(heatmap=True)
    trainer = make_trainer(tmp_path, callbacks=[callback], max_epochs=EPOCHS, limit_val_batches=2)
    trainer.fit(TwoSteps())
    lightning = _lightning_steps(tmp_path)
    assert trainer.global_step == 2 * BATCHES * EPOCHS
    assert lightning == [BATCHES * (epoch + 1) - 1 for epoch in range(EPOCHS)]
    library = _library_epoch_steps(tmp_path)
    assert "grad_flow/grad_norm/net.0 (scalars)" in library
    wrong = {tag: steps for tag, steps in library.items() if steps != lightning}
    assert not wrong, f"Lightning's epoch metrics at {lightning}; the library's: {wrong}"


def test_an_epochs_summary_and_its_last_logging_steps_text_never_share_a_tag_and_step(
    tmp_path: Path,
) -> None:
    """Every step a logging step, an alarm on every step: the epoch's last step has both texts."""
    callback = GradFlowCallback(alarms=AlarmRules(max_grad_norm=1e-9), chart=False)
    trainer = make_trainer(tmp_path, callbacks=[callback], max_epochs=EPOCHS, limit_val_batches=2)
    with pytest.warns(Warning):  # the alarm's warning, once per layer and epoch
        trainer.fit(Logs())
    texts = [(tag, step) for tag, step, plugin in _events(tmp_path) if plugin == "text"]
    twice = [key for key, n in Counter(texts).items() if n > 1]
    assert not twice, twice
    lightning = _lightning_steps(tmp_path)
    epoch_texts = sorted(step for tag, step in texts if tag == f"{ALARM_TEXT}/text_summary")
    step_texts = {step for tag, step in texts if tag == f"{ALARM_STEP_TEXT}/text_summary"}
    assert epoch_texts == lightning
    assert set(lightning) <= step_texts  # each epoch's last step logged its alarms' text too
    assert step_texts == set(range(BATCHES * EPOCHS))


class SkipsEpochOne(Logs):
    """Skips every batch of its second epoch (``on_train_batch_start`` returns -1): no batch of
    that epoch steps."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        return -1 if self.current_epoch == 1 else None


def test_an_epoch_in_which_no_batch_stepped_writes_no_second_summary_at_its_step(
    tmp_path: Path,
) -> None:
    """Its step is the epoch before it's, as Lightning's (which writes its ``epoch`` there twice):
    the statistics, with nothing measured, write nothing, and the alarms' summary of the epoch
    before it keeps its place."""
    callback = GradFlowCallback(alarms=AlarmRules(max_grad_norm=1e-9), chart=False)
    trainer = make_trainer(tmp_path, callbacks=[callback], max_epochs=3, limit_val_batches=2)
    with pytest.warns(Warning):  # the alarm's warning, once per layer and epoch
        trainer.fit(SkipsEpochOne())
    lightning = _lightning_steps(tmp_path)
    assert lightning == [BATCHES - 1, 2 * BATCHES - 1]  # the second epoch logged nothing
    events = _events(tmp_path)
    assert sorted(step for tag, step, _ in events if tag == "epoch") == sorted(2 * lightning)
    library = _library_epoch_steps(tmp_path)
    assert library["grad_flow/grad_norm/net.0 (scalars)"] == lightning
    assert library[f"{ALARM_TEXT}/text_summary (text)"] == lightning
    texts = [(tag, step) for tag, step, plugin in events if plugin == "text"]
    assert not [key for key, n in Counter(texts).items() if n > 1]
