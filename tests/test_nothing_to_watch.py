"""Nothing to watch: at the defaults every callback says so once and the run goes on; an explicit
selection that leaves nothing to measure fails at setup, naming its arguments, guard or not."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hooks import (
    ActivationStatsCallback,
    DeadReLUCallback,
    FeatureMapCallback,
    GradFlowCallback,
    LayerTimeCallback,
    LightningHooksWarning,
    SaturationCallback,
    TrainingAlarmWarning,
)

from conftest import TinyMLP, dataset, hooks_left, make_trainer, read_scalars


class BilinearNet(pl.LightningModule):
    """No activation module, no convolution, no Linear: a Bilinear layer and functional tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Bilinear(8, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(x, x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(), batch_size=8)


@pytest.mark.parametrize(
    ("callback", "family"),
    [
        (DeadReLUCallback(), "dead_relu/"),
        (SaturationCallback(), "saturation/"),
        (FeatureMapCallback(), "feature_map/"),
    ],
    ids=lambda c: type(c).__name__,
)
def test_defaults_with_nothing_to_watch_warn_once_and_train(
    callback: pl.Callback, family: str, tmp_path: Path
) -> None:
    model = BilinearNet()
    for fit in range(2):  # once per fit, and the reused callback says it again
        trainer = make_trainer(tmp_path / str(fit), callbacks=[callback, GradFlowCallback()])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(model)
        # Not the alarms: this 4-step run's loss can jump 10x at one batch (and a jump the run
        # does not come back from within the span is what *diverging* warns about).
        ours = [
            str(w.message)
            for w in caught
            if issubclass(w.category, LightningHooksWarning)
            and not issubclass(w.category, TrainingAlarmWarning)
        ]
        assert len(ours) == 1, ours
        name = type(callback).__name__
        assert ours[0].startswith(f"{name}: the model has no ")
        assert "to watch at the defaults; this callback does nothing in this fit" in ours[0]
        assert trainer.global_step == 4 and hooks_left(model) == []
        tags = read_scalars(tmp_path / str(fit))
        assert "grad_flow/grad_norm/mix" in tags  # the others measure as usual
        assert not any(tag.startswith(family) for tag in tags)


@pytest.mark.parametrize(
    ("callback", "message"),
    [
        (GradFlowCallback(include="net.1"), r"GradFlowCallback\(include=\('net.1',\)\)"),
        (GradFlowCallback(exclude="*"), r"GradFlowCallback\(exclude=\('\*',\)\)"),
        (GradFlowCallback(types=nn.ReLU), r"GradFlowCallback\(types=<class '.*ReLU'>\)"),
        (
            ActivationStatsCallback(types=nn.Tanh),
            r"ActivationStatsCallback\(types=<class '.*Tanh'>\)",
        ),
        (LayerTimeCallback(types=nn.Tanh), r"LayerTimeCallback\(types=<class '.*Tanh'>\)"),
        (LayerTimeCallback(exclude="net*"), r"LayerTimeCallback\(exclude=\('net\*',\)\)"),
        (DeadReLUCallback(include="net.0"), r"DeadReLUCallback\(include=\('net.0',\)\)"),
        (SaturationCallback(include="net.*"), r"SaturationCallback\(include=\('net.\*',\)\)"),
    ],
    ids=lambda c: type(c).__name__ if isinstance(c, pl.Callback) else "",
)
def test_explicit_selection_of_nothing_fails_at_setup_past_the_guard(
    callback: pl.Callback, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_HOOKS_STRICT", "0")  # the guard would turn errors into warnings
    model = TinyMLP()
    trainer = make_trainer(tmp_path, callbacks=[callback])
    with pytest.raises(ValueError, match=message + r": selects no .* of the model"):
        trainer.fit(model)
    assert trainer.global_step == 0 and hooks_left(model) == []


class LazyMLP(TinyMLP):
    """TinyMLP whose first layer is an ``nn.LazyLinear``: its size is known at the first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net[0] = nn.LazyLinear(16)


def test_lazy_parameters_are_refused_with_one_warning_and_the_run_goes_on(tmp_path: Path) -> None:
    # Reading an uninitialized parameter's numel at fit start would end the user's fit with
    # torch's ValueError ("Attempted to use an uninitialized parameter").
    model = LazyMLP()
    trainer = make_trainer(
        tmp_path / "lazy", callbacks=[GradFlowCallback(), ActivationStatsCallback()]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    ours = [str(w.message) for w in caught if issubclass(w.category, LightningHooksWarning)]
    assert ours == [
        "GradFlowCallback: the selected layers' lazy parameters ['net.0.weight', 'net.0.bias'] "
        "are not initialized before fit; this callback does nothing in this fit. Initialize them "
        "first: one forward of a sample batch before trainer.fit (or in the LightningModule's "
        "setup)"
    ]
    assert trainer.global_step == 4 and hooks_left(model) == []
    tags = read_scalars(tmp_path / "lazy")
    assert not any(tag.startswith("grad_flow/") for tag in tags)
    assert "activations/mean/net.0" in tags  # the others measure as usual
    # As the warning says: initialized by one forward, the same model is measured.
    trainer = make_trainer(tmp_path / "init", callbacks=[GradFlowCallback()])
    trainer.fit(model)
    assert "grad_flow/grad_norm/net.0" in read_scalars(tmp_path / "init")


def test_a_lazy_layer_left_out_of_the_selection_leaves_the_others_measured(tmp_path: Path) -> None:
    model = LazyMLP()
    trainer = make_trainer(tmp_path, callbacks=[GradFlowCallback(exclude="net.0")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert not [w for w in caught if issubclass(w.category, LightningHooksWarning)]
    tags = read_scalars(tmp_path)
    assert "grad_flow/grad_norm/net.2" in tags
    assert not any(tag.endswith("/net.0") for tag in tags)
