"""What an alarm says, read as a person reads it: a first line of at most 160 characters (who
speaks, the rule, the step, what happened, the one fix most likely to work), the details on
lines of their own, each fix once, in the order the evidence says, and a warning repeated
later quoting what is true at its step. Through ``Trainer.fit`` at the defaults; each event is
built deterministically: the model's returned loss is its true loss times a factor chosen per
step (the difference a constant), and its gradient is the true one times a gain chosen per step,
so the run's path up to the event does not depend on the machine's floating-point bits."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import AlarmRules, GradFlowCallback, TrainingAlarmWarning

from conftest import fit_alarms, read_alarm_texts

FIRST_LINE = 160
"""The most characters a warning's first line may have."""
STEPS = 40  # optimizer steps an epoch


class Scaled(pl.LightningModule):
    """A small ReLU regression on fixed noisy data that learns in a few dozen steps. At batch
    ``i`` it returns ``factor(i)`` times its loss, with ``gain(i)`` times its gradient."""

    def __init__(
        self, factor: Callable[[int], float], gain: Callable[[int], float] = lambda i: 1.0
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.factor = factor
        self.gain = gain
        self.losses: list[float] = []
        """Every returned loss, as the user logs it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        step = self.global_step
        gain = self.gain(step)
        returned = gain * loss + (self.factor(step) - gain) * loss.detach()
        self.losses.append(float(returned))
        return returned

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(STEPS * 32, 8, generator=gen)
        noise = 2.5 * torch.randn(len(x), 1, generator=gen)
        y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 3.0 + noise
        return DataLoader(TensorDataset(x, y), batch_size=32)


def _warnings(tmp_path: Path, model: Scaled, **trainer: Any) -> list[TrainingAlarmWarning]:
    """Fit ``model`` under ``GradFlowCallback()`` at its defaults: its alarm warnings."""
    fit = pl.Trainer(
        default_root_dir=tmp_path,
        callbacks=[GradFlowCallback()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **trainer,
    )
    return [w.message for w in fit_alarms(fit, model)]  # type: ignore[misc]


def _fixes(message: str) -> list[str]:
    """Every fix a message gives: its first line's, then its ``other fixes`` line's."""
    lines = message.splitlines()
    given = [lines[0].split("; fix: ", 1)[1]] if "; fix: " in lines[0] else []
    for line in lines[1:]:
        if line.startswith("other fixes: "):
            given += line.removeprefix("other fixes: ").split("; ")
    return given


def _read_at_a_glance(warning: TrainingAlarmWarning, texts: str) -> None:
    """The checks every warning passes: its first line, its fixes, its text in the event files."""
    message = str(warning)
    first, *details = message.splitlines()
    rule = warning.alarm.rule
    assert len(first) <= FIRST_LINE, first
    assert re.match(rf"GradFlowCallback \[{rule}\]: .* at optimizer step \d+", first), first
    fixes = _fixes(message)
    assert fixes and len(fixes) == len(set(fixes)), message
    for fix in fixes:
        assert message.count(fix) == 1, (fix, message)
    assert message.count("lower the learning rate") <= 1, message
    assert details, "the thresholds and the evidence on lines of their own"
    # the same text in the event files' alarm text: the first line, then the details under it
    said = first.removeprefix(f"GradFlowCallback [{rule}]: ")
    assert f", {warning.alarm.layer}: {said}\n" in texts
    for line in details:
        assert f"    - {line}" in texts


def test_an_explosion_leads_with_clipping_and_a_diverged_loss_with_the_learning_rate(
    tmp_path: Path,
) -> None:
    """One step's gradient 1e4x: the explosion's first fix is a clip at a value read from the
    run. The same explosion after the loss has diverged (it reads 10x from a few steps before):
    a lower learning rate comes first, clipping after it, each said once."""
    boom = 30
    gain = lambda i: 1e4 if i == boom else 1.0  # noqa: E731
    alone = _warnings(tmp_path / "alone", Scaled(lambda i: 1.0, gain), max_steps=boom + 1)
    explosion = next(w for w in alone if w.alarm.rule == "explosion")
    assert explosion.alarm.step == boom
    assert re.search(
        r"; fix: clip gradients at gradient_clip_val=[\d.e+-]+$", str(explosion).splitlines()[0]
    )
    assert "on_alarm={'explosion': 'skip'}" in str(explosion)
    risen = Scaled(lambda i: 10.0 if i >= boom - 6 else 1.0, gain)
    both = _warnings(tmp_path / "both", risen, max_steps=boom + 1)
    assert [w.alarm.rule for w in both][:1] == ["diverging"]
    explosion = next(w for w in both if w.alarm.rule == "explosion")
    fixes = _fixes(str(explosion))
    assert fixes[0] == "lower the learning rate"
    assert fixes[1].startswith("clip gradients at gradient_clip_val=")
    assert "the loss diverged too" in str(explosion)
    for run, record in (("alone", alone), ("both", both)):
        texts = "\n".join(read_alarm_texts(tmp_path / run))
        for warning in record:
            _read_at_a_glance(warning, texts)


def test_a_divergence_repeated_in_a_later_epoch_quotes_its_own_step(tmp_path: Path) -> None:
    """A blow-up (the loss reads 1e6x), then the loss reads 3x, still over the bar, for the
    rest of the run: confirmed once it holds, ``diverge_patience`` steps from the blow-up (one
    step alone is not a divergence). The warning repeated in the next epoch quotes that step's
    loss against its best and says since when the run diverges, not the running mean, which
    still remembers the blow-up."""
    blow_up = 20
    confirmed = blow_up + AlarmRules().diverge_patience - 1
    model = Scaled(lambda i: 1e6 if i == blow_up else 3.0 if i > blow_up else 1.0)
    record = _warnings(tmp_path, model, max_epochs=2)
    diverging = [w for w in record if w.alarm.rule == "diverging"]
    assert [w.alarm.step for w in diverging] == [confirmed, STEPS]
    first = str(diverging[0]).splitlines()[0]
    assert f"loss diverging at optimizer step {confirmed}: its running mean" in first
    again = str(diverging[1]).splitlines()
    loss = model.losses[STEPS]
    assert re.search(
        rf"at optimizer step {STEPS}: loss {loss:.4g} is [\d.]+x its best [\d.]+, diverging "
        rf"since step {blow_up}; fix: lower the learning rate$",
        again[0],
    ), again[0]
    assert any(line.startswith("it holds: its running mean") for line in again[1:])
    texts = "\n".join(read_alarm_texts(tmp_path))
    for warning in record:
        _read_at_a_glance(warning, texts)


@pytest.mark.parametrize("rule", ["nonfinite", "diverging"])
def test_a_nan_is_warned_at_a_glance(tmp_path: Path, rule: str) -> None:
    """A NaN loss and gradient at one step: *nonfinite* names the layer, *diverging* the loss;
    each first line ends with the fix most likely to work, a lower learning rate, said once."""
    nan = 12
    model = Scaled(lambda i: 1.0, lambda i: float("nan") if i == nan else 1.0)
    record = _warnings(tmp_path, model, max_steps=nan + 2)
    warning = next(w for w in record if w.alarm.rule == rule)
    assert warning.alarm.step == nan
    assert str(warning).splitlines()[0].endswith("; fix: lower the learning rate")
    texts = "\n".join(read_alarm_texts(tmp_path))
    for each in record:
        _read_at_a_glance(each, texts)
