"""Cadence: every callback with ``every_n_steps`` logs, at each logging step, what that step gives.

With a learning rate of 0 the weights never change, so a step's statistics depend on its batch
only: a run sampling steps 0 and 2 of 4 must log exactly what a run measuring every step logs on
a loader holding just batches 0 and 2. The default cadence is the Trainer's log_every_n_steps.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.utils.data import DataLoader, Subset

from lightning_hooks import (
    ActivationStatsCallback,
    AlarmRules,
    DeadReLUCallback,
    GradFlowCallback,
    SaturationCallback,
)

from conftest import (
    TinyMLP,
    TwoOptimizers,
    dataset,
    epoch_end_step,
    hooks_left,
    make_trainer,
    read_scalars,
)

CADENCED = (ActivationStatsCallback, DeadReLUCallback, SaturationCallback, GradFlowCallback)
FAMILIES = ("activations/", "dead_relu/", "saturation/", "grad_flow/")


class FrozenNet(TinyMLP):
    """ReLU and Tanh layers, learning rate 0; ``batches`` picks the loader's batches of 8."""

    def __init__(self, batches: tuple[int, ...] = (0, 1, 2, 3)) -> None:
        super().__init__(lr=0.0)
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
        )  # fmt: skip
        with torch.no_grad():
            self.net[0].bias.fill_(-0.5)  # some ReLU units fire rarely
            self.net[2].weight.mul_(8.0)  # some Tanh units saturate
        self.batches = batches

    def train_dataloader(self) -> DataLoader[Any]:
        rows = [8 * b + i for b in self.batches for i in range(8)]
        return DataLoader(Subset(dataset(), rows), batch_size=8)


# The gradient rules alone: these batches' losses differ by 3x, the loss rule's step-1 bound
# (it is tested on real data in test_divergence.py).
NO_IMAGES: dict[type, dict[str, Any]] = {
    GradFlowCallback: {"chart": False, "alarms": AlarmRules(diverge_ratio=None)},
    ActivationStatsCallback: {"heatmaps": False},
}


def _logged(
    root: Path, batches: tuple[int, ...], trainer_options: dict[str, Any], **kw: Any
) -> dict[str, float]:
    callbacks = [cls(**kw, **NO_IMAGES.get(cls, {})) for cls in CADENCED]
    make_trainer(root, callbacks=callbacks, **trainer_options).fit(FrozenNet(batches))
    scalars = read_scalars(root)
    return {tag: values[-1][1] for tag, values in scalars.items() if tag.startswith(FAMILIES)}


@pytest.mark.parametrize(
    ("options", "trainer_options"),
    [({"every_n_steps": 3}, {}), ({}, {"log_every_n_steps": 3})],
    ids=["every_n_steps=3", "default=log_every_n_steps=3"],
)
def test_logging_steps_equal_every_step_on_those_batches(
    tmp_path: Path, options: dict[str, Any], trainer_options: dict[str, Any]
) -> None:
    logging_step = _logged(tmp_path / "logging_step", (0, 1, 2, 3), trainer_options, **options)
    reference = _logged(tmp_path / "ref", (0, 2), {}, every_n_steps=1)
    everything = _logged(tmp_path / "all", (0, 1, 2, 3), {}, every_n_steps=1)
    for family in FAMILIES:
        assert any(tag.startswith(family) for tag in reference), family
    assert logging_step.keys() == reference.keys()
    for tag, want in reference.items():
        assert math.isclose(logging_step[tag], want, rel_tol=1e-5, abs_tol=1e-7), tag
    # The check can fail: every step of the four batches logs other values.
    differ = [t for t, v in reference.items() if not math.isclose(everything[t], v, rel_tol=1e-5)]
    assert any(t.startswith("activations/mean/") for t in differ)
    assert any(t.startswith("grad_flow/grad_norm/") for t in differ)
    assert reference["dead_relu/dead_count/net.1"] >= 1
    assert reference["saturation/saturated_fraction/net.3"] > 0


@pytest.mark.parametrize("cls", CADENCED)
@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_every_n_steps_is_validated(cls: type[pl.Callback], bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"{cls.__name__}\(every_n_steps={bad!r}\): must be a"):
        cls(every_n_steps=bad)


@pytest.mark.parametrize("cls", [GradFlowCallback, ActivationStatsCallback])
def test_no_step_logging_in_the_trainer_is_refused_at_setup(
    tmp_path: Path, cls: type[pl.Callback]
) -> None:
    """``Trainer(log_every_n_steps=0)`` leaves a callback that takes the Trainer's cadence no
    logging step: the fit stops at setup, before any step is measured."""
    model = TinyMLP()
    trainer = make_trainer(tmp_path, callbacks=[cls()], log_every_n_steps=0)
    with pytest.raises(
        MisconfigurationException,
        match=rf"{cls.__name__}\(every_n_steps=None\).*Trainer\(log_every_n_steps=0\).*"
        rf"{cls.__name__}\(every_n_steps=N\)",
    ):
        trainer.fit(model)
    assert trainer.global_step == 0
    assert hooks_left(model) == []


def test_a_cadence_of_its_own_measures_without_the_trainers_logging_steps(
    tmp_path: Path,
) -> None:
    """With ``every_n_steps=5`` the callback keeps its cadence under ``log_every_n_steps=0``:
    steps 4, 9, ... and each epoch's first (0, 4 and 8: three epochs of 4 steps)."""
    callback = GradFlowCallback(every_n_steps=5, chart=False)
    make_trainer(tmp_path, max_epochs=3, callbacks=[callback], log_every_n_steps=0).fit(TinyMLP())
    scalars = read_scalars(tmp_path)
    assert [step for step, _ in scalars["grad_flow/grad_norm_step/net.0"]] == [0, 4, 8, 9]
    # the epoch aggregates, over those logging steps, at each epoch end
    assert [step for step, _ in scalars["grad_flow/grad_norm/net.0"]] == [
        epoch_end_step(4 * epoch) for epoch in (1, 2, 3)
    ]


def test_a_batch_that_steps_several_optimizers_is_measured_when_it_holds_a_logging_step(
    tmp_path: Path,
) -> None:
    """Two optimizer steps a batch, every 4 optimizer steps: the batches starting at steps 2 and
    6 hold steps 3 and 7, and the epoch's first is measured too. With one step a batch the
    cadence would meet only even steps, and measure the epoch's first batch alone."""
    model = TwoOptimizers()
    callback = GradFlowCallback(every_n_steps=4, alarms=False, chart=False)
    make_trainer(tmp_path, callbacks=[callback]).fit(model)
    scalars = read_scalars(tmp_path)
    for layer in ("net.0", "net.4"):
        logged = scalars[f"grad_flow/grad_norm_step/{layer}"]
        assert [s for s, _ in logged] == [0, 2, 6], layer  # 4 batches: steps 0 to 7
        for step, value in logged:
            assert math.isclose(value, model.norms[step][layer], rel_tol=1e-5), (layer, step)
