"""SaturationCallback through a real fit, against plain torch on the same activations."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import FeatureMapCallback, LightningHooksWarning, SaturationCallback
from lightning_hooks.core import SaturationTracker, saturation_mask, unit_saturation
from lightning_hooks.core.stats import stat as states_module

from conftest import TinyMLP, epoch_end_step, hooks_left, read_scalars
from syncs import count_syncs

WATCHED = {"net.1": "tanh", "net.3": "sigmoid"}


class BoundedNet(pl.LightningModule):
    """Linear -> Tanh -> Linear -> Sigmoid -> Linear; 4 batches of 8 per epoch.

    ``saturate=True`` pins 12 of the 16 tanh units at ``tanh(+-6)`` (bias 6, tiny weights) and
    scales the other weights up, so that many outputs and most units saturate.
    Records every training activation of the two watched modules, independently of the library.
    """

    def __init__(self, saturate: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Sigmoid(), nn.Linear(16, 1)
        )
        with torch.no_grad():
            self.net[0].weight.mul_(2.0)  # healthy: a few saturated outputs, no saturated unit
            if saturate:
                self.net[0].weight[:12].mul_(0.01)
                self.net[0].bias[:12] = torch.where(torch.arange(12) % 2 == 0, 6.0, -6.0)
                self.net[0].weight[12:].mul_(4.0)
                self.net[2].weight.mul_(6.0)
        self.seen: list[dict[str, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        record = self.training and torch.is_grad_enabled()
        outputs = {}
        for i, module in enumerate(self.net):
            x = module(x)
            if f"net.{i}" in WATCHED:
                outputs[f"net.{i}"] = x.detach().clone()
        if record:
            self.seen.append(outputs)
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(32, 8, generator=g)
        return DataLoader(TensorDataset(x, x[:, :1].tanh()), batch_size=8)


def _reference(seen: list[dict[str, torch.Tensor]], layer: str) -> tuple[float, float, int]:
    """Plain torch: saturated fraction, always-saturated fraction and count, over ``seen``."""
    out = torch.cat([step[layer] for step in seen])
    saturated = out.abs() > 0.99 if WATCHED[layer] == "tanh" else (out < 0.01) | (out > 0.99)
    always = saturated.all(dim=0)
    return saturated.float().mean().item(), always.float().mean().item(), int(always.sum())


def _fit(trainer_factory: Any, model: BoundedNet, **kwargs: Any) -> None:
    callbacks = [SaturationCallback(**kwargs), FeatureMapCallback()]
    trainer_factory(callbacks=callbacks, max_epochs=2).fit(model)


def test_saturated_layers_match_plain_torch_and_warn(trainer_factory: Any, tmp_path: Path) -> None:
    model = BoundedNet(saturate=True)
    with pytest.warns(LightningHooksWarning) as caught:
        _fit(trainer_factory, model)
    scalars = read_scalars(tmp_path)
    expected_warnings: list[str] = []
    repeats: dict[str, int] = {}
    for epoch, step in enumerate((epoch_end_step(4), epoch_end_step(8))):
        seen = model.seen[4 * epoch : 4 * epoch + 4]
        for layer in WATCHED:
            fraction, always, k = _reference(seen, layer)
            assert (step, pytest.approx(fraction, abs=1e-6)) in scalars[
                f"saturation/saturated_fraction/{layer}"
            ]
            assert (step, pytest.approx(always, abs=1e-6)) in scalars[
                f"saturation/always_saturated_fraction/{layer}"
            ]
            if k > 0 and always >= 0.5 and layer in repeats:
                repeats[layer] += 1
            elif (
                k > 0 and always >= 0.5
            ):  # the first finding of a layer warns, the rest are counted
                repeats[layer] = 0
                expected_warnings.append(f"layer {layer!r} has {k} of 16 units")
    assert len(model.seen) == 8  # the feature-map probe forwards were not recorded
    assert any("net.1" in w for w in expected_warnings) and sum(repeats.values()) > 0
    messages = [str(w.message) for w in caught if w.category is LightningHooksWarning]
    assert len(messages) == len(expected_warnings) + 1
    for text, message in zip(expected_warnings, messages, strict=False):
        assert text in message and "saturated on every training sample" in message
    held = ", ".join(f"{layer} x{n}" for layer, n in repeats.items() if n)
    assert messages[-1] == (
        f"SaturationCallback: {sum(repeats.values())} more saturation findings held back after "
        f"the first warning per layer: {held}"
    )
    assert hooks_left(model) == []


def test_healthy_layers_match_plain_torch_and_do_not_warn(
    trainer_factory: Any, tmp_path: Path
) -> None:
    model = BoundedNet(saturate=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LightningHooksWarning)
        _fit(trainer_factory, model)
    scalars = read_scalars(tmp_path)
    for layer in WATCHED:
        fraction, always, _ = _reference(model.seen[4:], layer)
        ((_, _), (step, logged)) = scalars[f"saturation/saturated_fraction/{layer}"]
        assert (
            step == epoch_end_step(8)
            and logged == pytest.approx(fraction, abs=1e-6)
            and logged < 0.5
        )
        assert scalars[f"saturation/always_saturated_fraction/{layer}"][-1][1] == always == 0
    ((_, _), (_, layers)) = scalars["saturation/global/layers"]
    assert layers == 2


def test_no_host_sync_during_training_steps(
    monkeypatch: pytest.MonkeyPatch, trainer_factory: Any
) -> None:
    class Window(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            counter.active = True

        def on_train_epoch_end(self, *args: Any) -> None:
            counter.active = False

    with count_syncs(monkeypatch) as counter:
        callback = SaturationCallback(warn_at=None)
        trainer_factory(callbacks=[Window(), callback]).fit(BoundedNet(True))
    assert dict(counter.calls) == {}


def test_model_without_bounded_activations_says_so_and_logs_nothing(
    trainer_factory: Any, tmp_path: Path
) -> None:
    with pytest.warns(LightningHooksWarning, match=r"no bounded activation module .* to watch"):
        trainer_factory(callbacks=[SaturationCallback()]).fit(TinyMLP())
    assert read_scalars(tmp_path) == {}


@pytest.mark.parametrize(
    ("module", "values", "expected"),
    [
        (nn.Sigmoid(), [0.005, 0.5, 0.995], [True, False, True]),
        (nn.Softsign(), [-0.995, 0.98, 0.999], [True, False, True]),
        (nn.Hardtanh(-2.0, 3.0), [-2.0, 2.9, 3.0], [True, False, True]),
        (nn.Hardsigmoid(), [0.0, 0.5, 1.0], [True, False, True]),
    ],
)
def test_masks_per_type(module: nn.Module, values: list[float], expected: list[bool]) -> None:
    assert saturation_mask(module, torch.tensor(values)).tolist() == expected


def test_units_along_the_last_dim_of_a_sequence() -> None:
    mask = torch.zeros(2, 5, 3, dtype=torch.bool)
    mask[..., 1] = True
    count, unsaturated = unit_saturation(mask, unit_dim=-1)
    assert int(count) == 10 and unsaturated.tolist() == [True, False, True]


def test_tracker_reduces_counts_by_sum_flags_by_max_and_errors_on_changing_units(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = nn.Sequential(nn.Linear(2, 4), nn.Tanh())
    tracker = SaturationTracker(model)
    with torch.no_grad():
        model(torch.randn(3, 2) * 50)  # not a training forward: not counted
    model(torch.randn(3, 2) * 50)
    once = tracker.result()
    # a second rank that saw the same: one all-gather of every state, packed
    monkeypatch.setattr(states_module, "all_gather_stacked", lambda t, g=None: torch.stack([t, t]))
    monkeypatch.setattr(states_module, "is_distributed", lambda: True)
    twice = tracker.result()
    assert once.entries.tolist() == [12] and twice.entries.tolist() == [24]
    np.testing.assert_array_equal(twice.saturated, 2 * once.saturated)
    np.testing.assert_array_equal(twice.always_saturated, once.always_saturated)
    with pytest.raises(ValueError, match=r"unit_dim=0\): layer '1' had 3 units, now 5"):
        tracker_rows = SaturationTracker(model, unit_dim=0)
        model(torch.randn(3, 2))
        model(torch.randn(5, 2))
    tracker.remove()
    tracker_rows.remove()
    assert hooks_left(model) == []


def test_a_tracker_attached_to_another_model_counts_that_model_only() -> None:
    first = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 3), nn.Tanh())
    second = nn.Sequential(nn.Linear(2, 3), nn.Tanh())
    tracker = SaturationTracker(first)
    first(torch.randn(4, 2))  # counted on the host, not yet moved into the states
    tracker.attach(second)
    second(torch.randn(5, 2))
    assert tracker.result().entries.tolist() == [15]
    tracker.remove()


def test_bad_arguments_name_the_culprit() -> None:
    with pytest.raises(
        ValueError,
        match=r"SaturationCallback\(warn_at=1.5\): must be a finite real >= 0.0 and <= 1.0",
    ):
        SaturationCallback(warn_at=1.5)
    with pytest.raises(
        TypeError, match=r"warn_above=...\): unknown argument \(did you mean 'warn_at'"
    ):
        SaturationCallback(warn_above=0.5)  # type: ignore[call-arg]  # the unreleased alias
    with pytest.raises(
        TypeError, match=r"SaturationCallback\(types=.*ReLU.*must be a subclass of one"
    ):
        SaturationCallback(types=nn.ReLU)
