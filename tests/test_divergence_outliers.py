"""An outlier batch under SGD with momentum: the rise that follows it is its echo, a notice and
never a divergence; a real divergence on the same run is still warned in time. Through
``Trainer.fit`` at every default of ``GradFlowCallback`` but ``on_alarm="stop"``.

The run: an MLP with BatchNorm on scikit-learn's breast-cancer set (30 standardised features,
2 classes), batches of 32 drawn from a seeded generator, SGD at 0.05 with momentum 0.9, 180
optimizer steps. It learns in a few dozen steps. At step :data:`AT` it meets an outlier: its
loss (and so its gradient) 10x or 30x, or the labels of two steps' batches shifted by one
class (a real loss and gradient). Momentum carries the outlier's update on for some ten steps,
so the loss rises over several steps after the run came back, then falls back: a setback,
logged. A real divergence is built from the same run: its learning rate raised 100x from step
:data:`AT`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hooks import GradFlowCallback

from conftest import fit_alarms, load_benchmark, read_scalars

STEPS = 180
AT = 120  # the optimizer step of the event
LR = 0.05


def _cancer() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's ``load_breast_cancer``, standardised."""
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    return x, torch.tensor(data.target, dtype=torch.long)


class Momentum(pl.LightningModule):
    """The MLP with BatchNorm on SGD with momentum; at :data:`AT`, the event: ``scale`` times
    the loss, ``shifted`` steps of labels shifted by one class, or the learning rate times
    ``lr_factor`` from then on."""

    def __init__(
        self,
        scale: float = 1.0,
        shifted: int = 0,
        lr_factor: float = 1.0,
        read: dict[int, float] | None = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(30, 128), nn.BatchNorm1d(128), nn.ReLU(),
            nn.Linear(128, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 2),
        )  # fmt: skip
        self.scale = scale
        self.shifted = shifted
        self.lr_factor = lr_factor
        self.read = read or {}
        """Per step, the loss the step reads (its gradient is the batch's own)."""
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if AT <= batch_idx < AT + self.shifted:
            y = (y + 1) % 2
        if batch_idx == AT and self.lr_factor != 1.0:
            for group in self.optimizers().optimizer.param_groups:  # type: ignore[union-attr]
                group["lr"] = LR * self.lr_factor
        loss = nn.functional.cross_entropy(self.net(x), y)
        if batch_idx == AT:
            loss = loss * self.scale
        if batch_idx in self.read:
            loss = loss + (self.read[batch_idx] - loss.detach())
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    def train_dataloader(self) -> Any:
        x, y = _cancer()
        gen = torch.Generator().manual_seed(0)
        picks = [torch.randint(0, len(x), (32,), generator=gen) for _ in range(STEPS)]
        return DataLoader([(x[idx], y[idx]) for idx in picks], batch_size=None)


def _fit(tmp_path: Path, model: Momentum) -> tuple[list[Any], dict[str, list[tuple[int, float]]]]:
    """Fit under ``on_alarm="stop"``: the warnings, and the scalars logged."""
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        callbacks=[GradFlowCallback(on_alarm="stop")],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    return fit_alarms(trainer, model), read_scalars(tmp_path)


def _count(scalars: dict[str, list[tuple[int, float]]], tag: str) -> float:
    return sum(v for _, v in scalars.get(tag, []))


@pytest.mark.parametrize(
    ("scale", "shifted"),
    [(10.0, 0), (30.0, 0), (1.0, 2)],
    ids=["loss-10x", "loss-30x", "labels-x2"],
)
def test_an_outlier_under_momentum_is_a_notice_never_a_divergence_or_a_stop(
    tmp_path: Path, scale: float, shifted: int
) -> None:
    """The outlier's echo rises over several steps after the run came back; a setback, logged,
    and the fit runs to its end."""
    model = Momentum(scale=scale, shifted=shifted)
    record, scalars = _fit(tmp_path, model)
    assert [str(w.message) for w in record] == []
    assert len(model.losses) == STEPS  # nothing stopped the fit
    assert _count(scalars, "grad_flow/alarms/diverging") == 0
    assert _count(scalars, "grad_flow/notices/setback") >= 1
    before = float(np.median(model.losses[AT - 20 : AT]))
    echo = model.losses[AT + shifted + 1 : AT + 12]
    assert max(echo) > 3 * before  # a rise after the run came back, not only the outlier
    assert float(np.median(model.losses[-20:])) < 2 * before  # and the run recovered


def test_a_real_divergence_on_the_same_run_is_warned_in_time(tmp_path: Path) -> None:
    """The learning rate raised 100x at :data:`AT`: the loss leaves its level for good, and
    *diverging* is warned in time (no later than 3 steps after the step the benchmark's ground
    truth calls divergent, its mean loss of 5 steps twice its best) and stops the fit."""
    model = Momentum(lr_factor=100.0)
    record, scalars = _fit(tmp_path, model)
    alarms = [w.message.alarm for w in record if getattr(w.message, "alarm", None) is not None]
    assert [a.rule for a in alarms][:1] == ["diverging"]
    at = alarms[0].step
    diverged = load_benchmark("divergence")._first_divergence(np.array(model.losses))
    assert diverged is not None and diverged >= AT
    assert at <= diverged + 3
    assert len(model.losses) == at + 1  # stopped at the step it was confirmed
    assert _count(scalars, "grad_flow/alarms/diverging") == 1


def _losses(echo: float, outlier: float = 5.0) -> list[float]:
    """A run that learns (2.0 down to 0.1 in 30 steps, then 0.1 and 0.11 by turns), an outlier
    of ``outlier`` at step 60, back at step 61, then a rise to ``echo`` over steps 62-67, then
    back again."""
    learn = [2.0 - 1.9 * step / 30 for step in range(30)]
    floor = [0.1 if step % 2 else 0.11 for step in range(30)]
    after = [0.1, *[echo] * 6, *[0.1 if step % 2 else 0.11 for step in range(20)]]
    return [*learn, *floor, outlier, *after]


def _rules_alarms(losses: list[float], resume_at: int | None = None) -> list[tuple[int, str]]:
    """The loss rules' alarms on ``losses`` (one a step); with ``resume_at``, their state saved
    before that step and loaded into new rules, as a resumed fit does."""
    from lightning_hooks import AlarmRules
    from lightning_hooks.core.alarms.loss import LossRules

    rules = LossRules(AlarmRules(), torch.device("cpu"))
    found = []
    for step, x in enumerate(losses):
        if step == resume_at:
            state = rules.state_dict()
            rules = LossRules(AlarmRules(), torch.device("cpu"))
            rules.load_state_dict(state)
        found += [(a.step, a.rule) for a in rules.evaluate(x, step) if a.counts]
    return found


@pytest.mark.parametrize("resume_at", [None, 64], ids=["straight", "resumed-mid-echo"])
def test_the_echo_of_an_outlier_is_held_and_a_rise_past_the_outlier_is_not(
    resume_at: int | None,
) -> None:
    """Six steps at 1.5 (15x the run's floor, over the bar) after an outlier of 5.0 the run
    came back from: a setback, never *diverging*, also across a checkpoint; the same rise to
    6.0, past the outlier's own loss, is confirmed."""
    assert [r for _, r in _rules_alarms(_losses(1.5), resume_at)] == ["setback"]
    assert ("diverging", 64) in {(r, s) for s, r in _rules_alarms(_losses(6.0), resume_at)}


def _falls_back(level: float) -> dict[int, float]:
    """Two outlier steps at 3.0, then six steps at ``level``: the loss each step reads."""
    return {AT: 3.0, AT + 1: 3.0, **{step: level for step in range(AT + 2, AT + 8)}}


def test_an_outlier_the_loss_falls_back_from_is_a_notice_while_still_over_the_bar(
    tmp_path: Path,
) -> None:
    """Two steps read 3.0, then six read 0.55: over the bar (twice the run's best and more),
    but under half the outliers' loss and under where the run started. The outlier's damage
    that the run is recovering from: a setback, logged, and the fit runs to its end."""
    model = Momentum(read=_falls_back(0.55))
    record, scalars = _fit(tmp_path, model)
    start = float(np.mean(model.losses[:3]))
    best = min(model.losses[:AT])
    assert 4 * best < 0.55 < start  # the steps after: over the bar, under the run's start
    assert [str(w.message) for w in record] == []
    assert len(model.losses) == STEPS
    assert _count(scalars, "grad_flow/alarms/diverging") == 0
    assert _count(scalars, "grad_flow/notices/setback") >= 1


def test_a_loss_that_falls_back_to_over_the_run_start_is_confirmed(tmp_path: Path) -> None:
    """The same outliers, then six steps at 0.9, over where the run started: all it had learnt
    lost. Confirmed as *diverging* at the third step over the bar, and the fit stops there."""
    model = Momentum(read=_falls_back(0.9))
    record, scalars = _fit(tmp_path, model)
    assert float(np.mean(model.losses[:3])) < 0.9
    alarms = [w.message.alarm for w in record if getattr(w.message, "alarm", None) is not None]
    assert [(a.rule, a.step) for a in alarms] == [("diverging", AT + 2)]
    assert len(model.losses) == AT + 3
    assert _count(scalars, "grad_flow/alarms/diverging") == 1


def _falling_back(*after: float) -> list[float]:
    """The run of :func:`_losses`, with two outlier steps of 5.0 at 60-61, then the steps
    ``after``, then the floor again."""
    learn = [2.0 - 1.9 * step / 30 for step in range(30)]
    floor = [0.1 if step % 2 else 0.11 for step in range(30)]
    return [*learn, *floor, 5.0, 5.0, *after, *floor[:20]]


@pytest.mark.parametrize("resume_at", [None, 64], ids=["straight", "resumed-mid-echo"])
def test_a_fall_back_from_outliers_is_held_unless_it_lost_the_run_or_passes_them(
    resume_at: int | None,
) -> None:
    """Six steps at 1.6 after two at 5.0: over the bar, under half the outliers' loss and under
    the run's start of 2.0: held as their echo, a setback. At 2.2, over the start, the third
    step over the bar confirms; so does a climb past the outliers' loss after the fall back."""
    held = _rules_alarms(_falling_back(*[1.6] * 6), resume_at)
    assert [r for _, r in held] == ["setback"]
    lost = _rules_alarms(_falling_back(*[2.2] * 6), resume_at)
    assert ("diverging", 62) in {(r, s) for s, r in lost}
    past = _rules_alarms(_falling_back(1.6, 1.6, 6.0, 6.0, 6.0), resume_at)
    assert ("diverging", 66) in {(r, s) for s, r in past}
