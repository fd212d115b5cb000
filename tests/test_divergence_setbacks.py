"""A setback is noticed, a divergence is warned on confirmation, and a noisy loss stays quiet:
through ``Trainer.fit`` at every default, each event built deterministically. The model trains
smoothly (a linear regression on fixed noisy data: it learns in a few dozen steps, then sits
at its noise floor); the loss it *returns* is its
true loss times a factor chosen per step, added as a constant so the gradient is untouched. So
the run's path does not depend on the machine's floating-point bits, and the event is exactly
where the test puts it."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import AlarmRules, GradFlowCallback
from lightning_hooks.tags import NOTICES

from conftest import epoch_end_step, fit_alarms, read_alarm_texts, read_scalars

STEPS = 120
START = 60  # the step the event starts at


class ScaledLoss(pl.LightningModule):
    """A linear regression on fixed data whose returned loss is ``factor(step)`` times its own
    (the difference a constant: the gradient is the true loss's)."""

    def __init__(self, factor: Callable[[int], float]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(8, 1)
        self.factor = factor
        self.losses: list[float] = []
        """Every micro-batch's returned loss, as the user logs it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        scale = self.factor(batch_idx)
        returned = loss + (scale - 1.0) * loss.detach()
        self.losses.append(float(returned))
        return returned

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(STEPS * 32, 8, generator=gen)
        noise = 2.5 * torch.randn(len(x), 1, generator=gen)  # the loss's floor: about 6
        y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 3.0 + noise
        return DataLoader(TensorDataset(x, y), batch_size=32)


def _fit(tmp_path: Path, model: ScaledLoss, **trainer: Any) -> list[Any]:
    """Fit at every default of ``GradFlowCallback`` and the ``Trainer`` (but the arguments
    given): the ``TrainingAlarmWarning``s."""
    callback = trainer.pop("callback", GradFlowCallback())
    fit = pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **trainer,
    )
    return fit_alarms(fit, model)


def _count(logdir: Path, rule: str) -> float:
    """The epoch's count of ``rule`` in the event files: under ``notices`` for a notice (the
    setback), under ``alarms`` for a rule that warns."""
    kind = "notices" if rule in NOTICES else "alarms"
    rows = read_scalars(logdir)[f"grad_flow/{kind}/{rule}"]
    return sum(v for _, v in rows)


def test_a_setback_that_recovers_is_logged_and_not_warned(tmp_path: Path) -> None:
    """One corrupted batch, its loss 7x: a setback opens at its step, logged with the step and
    the rise, then logged again as recovered; nothing is warned."""
    model = ScaledLoss(lambda step: 7.0 if step == START else 1.0)
    assert _fit(tmp_path, model) == []
    assert _count(tmp_path, "setback") == 1
    assert _count(tmp_path, "diverging") == 0
    text = "\n".join(read_alarm_texts(tmp_path))
    assert re.search(rf"loss setback at optimizer step {START}: its running mean [\d.]+ rose", text)
    assert "most setbacks recover" in text
    recovered = re.search(rf"setback of optimizer step {START} recovered at step (\d+)", text)
    assert recovered, text
    assert START < int(recovered.group(1)) <= START + 5  # the running mean falls back


@pytest.mark.parametrize(
    ("factor", "bad_steps", "accumulate"),
    [(30.0, 1, 1), (10.0, 2, 1), (30.0, 2, 1), (10.0, 1, 4), (30.0, 2, 4)],
    ids=["one-step-30x", "two-steps-10x", "two-steps-30x", "accumulated-10x", "accumulated-30x"],
)
def test_one_or_two_outlier_steps_are_a_notice_never_a_divergence_or_a_stop(
    tmp_path: Path, factor: float, bad_steps: int, accumulate: int
) -> None:
    """A healthy run meets an outlier: one step's batches, or two steps' in a row (a corrupted
    row, a batch of wrong labels), read ``factor`` times their loss, then the run goes on as
    before. Under ``on_alarm="stop"`` it is a setback, logged, and never *diverging* nor a stop:
    the median of the last steps' losses, which one or two steps cannot move, is what is held
    to ``diverge_lost`` x the run's start, where the running mean remembers the outlier."""
    step = START // accumulate  # the event's optimizer step, half-way through the fit
    first = step * accumulate  # its first micro-batch

    def outlier(batch: int) -> float:
        return factor if first <= batch < first + bad_steps * accumulate else 1.0

    model = ScaledLoss(outlier)
    callback = GradFlowCallback(on_alarm="stop")
    trainer_args = {"accumulate_grad_batches": accumulate, "callback": callback}
    assert _fit(tmp_path, model, **trainer_args) == []
    assert _count(tmp_path, "diverging") == 0
    steps = [s for s, _ in read_scalars(tmp_path)["grad_flow/grad_norm/net"]]
    # the fit ran to its end: nothing stopped it
    assert steps == [epoch_end_step(STEPS // accumulate)]
    if factor * bad_steps >= 20:  # a rise the running mean shows: noticed, logged, reported
        assert _count(tmp_path, "setback") == 1
        texts = "\n".join(read_alarm_texts(tmp_path))
        assert f"loss setback at optimizer step {step}" in texts


def test_outlier_steps_and_a_hard_batch_after_the_run_came_back_are_no_divergence(
    tmp_path: Path,
) -> None:
    """Two outlier steps (10x), a step back under the bar, then one hard batch (3x): the
    running mean still remembers the outliers, but no ``diverge_patience`` steps in a row were
    over the bar. A setback, logged; never *diverging*, nor a stop."""
    hard = {START: 10.0, START + 1: 10.0, START + 3: 3.0}
    model = ScaledLoss(lambda step: hard.get(step, 1.0))
    assert _fit(tmp_path, model, callback=GradFlowCallback(on_alarm="stop")) == []
    assert _count(tmp_path, "diverging") == 0
    assert _count(tmp_path, "setback") == 1


def test_a_setback_that_holds_is_warned_diverging_on_confirmation(tmp_path: Path) -> None:
    """The loss 3x its own from one step on: once its running mean crosses the bar a setback
    opens, and once ``diverge_patience`` of its steps' losses are over the bar themselves it is
    confirmed and warned; the warning names the setback it confirms."""
    model = ScaledLoss(lambda step: 3.0 if step >= START else 1.0)
    record = _fit(tmp_path, model)
    patience = AlarmRules().diverge_patience
    assert [w.message.alarm.rule for w in record][:1] == ["diverging"]
    text = "\n".join(read_alarm_texts(tmp_path))
    opened = re.search(r"loss setback at optimizer step (\d+)", text)
    assert opened, text
    start = int(opened.group(1))
    assert START <= start < START + 5  # the running mean takes a few losses to cross
    first = record[0].message.alarm
    # who speaks comes first, whatever formatter prints the warning
    assert str(record[0].message).startswith("GradFlowCallback [diverging]: loss diverging at")
    assert first.step == start + patience - 1
    assert f"the setback of optimizer step {start} is confirmed" in str(first.message)
    assert f"stayed over the bar for {patience} optimizer steps" in str(first.message)
    assert "lower the learning rate" in str(first.message)
    assert "%" not in str(first.message) and "%" not in text  # rises as ratios and losses
    assert _count(tmp_path, "setback") == 1


def test_stop_acts_on_a_divergence_and_never_on_a_setback(tmp_path: Path) -> None:
    """Under ``on_alarm="stop"``: a setback that recovers lets the fit run to its end; one that
    holds stops it at the step it is confirmed."""
    recovered = ScaledLoss(lambda step: 7.0 if step == START else 1.0)
    assert _fit(tmp_path / "setback", recovered, callback=GradFlowCallback(on_alarm="stop")) == []
    assert len(recovered.losses) == STEPS
    held = ScaledLoss(lambda step: 3.0 if step >= START else 1.0)
    record = _fit(tmp_path / "held", held, callback=GradFlowCallback(on_alarm="stop"))
    at = record[0].message.alarm.step
    assert len(held.losses) == at + 1 < STEPS
    # and the fit's end says, once, that an alarm stopped it
    said = [str(w.message) for w in record if "ended the fit" in str(w.message)]
    assert len(said) == 1, said
    assert said[0].startswith(
        f"GradFlowCallback [diverging]: on_alarm='stop' ended the fit at optimizer step {at + 1}, "
        f"after the diverging alarm of step {at}"
    )


def _swings(seed: int) -> Callable[[int], float]:
    """A micro-batch's loss swinging up to 3x from the next, as documents of mixed difficulty
    make it: a factor between 1/1.7 and 1.7 per step, drawn once from ``seed``."""
    rng = np.random.default_rng(seed)
    factors = np.exp(rng.uniform(-math.log(1.7), math.log(1.7), STEPS * 8))
    return lambda step: float(factors[step])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_noisy_micro_batch_of_one_reaches_no_setback(tmp_path: Path, seed: int) -> None:
    """Losses that swing 2-3x from one micro-batch to the next while the run learns: no
    setback, no warning, with and without gradient accumulation (every micro-batch's loss is
    read)."""
    model = ScaledLoss(_swings(seed))
    assert _fit(tmp_path / "one", model) == []
    swings = np.array(model.losses[1:]) / np.array(model.losses[:-1])
    assert swings.max() > 2.0 and swings.min() < 0.5  # the noise is what the test says
    assert _count(tmp_path / "one", "setback") == 0
    accumulated = ScaledLoss(_swings(seed))
    assert _fit(tmp_path / "accum", accumulated, accumulate_grad_batches=4) == []
    assert _count(tmp_path / "accum", "setback") == 0


def test_under_accumulation_spans_and_patience_count_optimizer_steps(tmp_path: Path) -> None:
    """Under ``accumulate_grad_batches=4`` the rule reads 4 losses a step: its running mean
    spans ``diverge_span`` steps of them, and a setback holds by steps, on each step's mean
    loss. Three hard micro-batches of one step (each 5x) are one hard step, not a divergence
    (counted as 3 losses over the bar, they were warned). The loss 4x from one step on is
    warned within ``diverge_patience`` steps of its rise, as without accumulation."""
    bad_step = ScaledLoss(lambda i: 5.0 if START <= i < START + 3 else 1.0)
    assert _fit(tmp_path / "step", bad_step, accumulate_grad_batches=4) == []
    assert _count(tmp_path / "step", "diverging") == 0
    held = ScaledLoss(lambda i: 4.0 if i >= START else 1.0)
    record = _fit(tmp_path / "held", held, accumulate_grad_batches=4)
    first = record[0].message.alarm
    assert first.rule == "diverging"
    assert START // 4 < first.step <= START // 4 + AlarmRules().diverge_patience + 1
    assert "stayed over the bar for 3 optimizer steps" in str(first.message)


def test_a_state_saved_by_0_2_0_loads() -> None:
    """0.2.0 saved *diverging*'s state as ``[mean, deviation, best, first]``, the losses seen
    and its open rise, and counted recovered rises as ``transient``: such a state loads, its
    levels in place and its count under ``setback``."""
    from lightning_hooks.core import TrainingAlarms

    alarms = TrainingAlarms(["net", "global"])
    state = alarms.state_dict()
    for key in ("version", "loss_levels", "loss_setback"):  # release 0.2.0 saved no version
        del state[key]
    counts = {k: v for k, v in state["counts"].items() if k != "setback"}
    state.update(
        diverging=torch.tensor([0.9, 0.1, 0.8, 2.3]),
        loss_seen=40,
        loss_rise=[],
        counts={**counts, "transient": 2},
    )
    loaded = TrainingAlarms(["net", "global"])
    loaded.load_state_dict(state)
    levels = loaded.state_dict()["loss_levels"]
    assert levels["seen"] == 40
    assert levels["mean"] == pytest.approx(0.9) and levels["best"] == pytest.approx(0.8)
    assert levels["first"] == pytest.approx(2.3) and levels["jitter"] == pytest.approx(0.1)
    assert loaded.counts["setback"] == 2 and "transient" not in loaded.counts
    # and it goes on judging: a loss far over its best opens a setback
    for step in range(3):
        loaded.update_loss(torch.tensor(9.0), step=40 + step)
    assert [a.rule for a in loaded.poll(wait=True)][:1] == ["setback"]


def test_under_accumulation_the_losses_quoted_are_the_users_own(tmp_path: Path) -> None:
    """Lightning hands the batch-end hooks the loss divided by ``accumulate_grad_batches``; the
    alarm quotes the loss the user logs: the micro-batch's own, not a quarter of it."""
    model = ScaledLoss(lambda step: 3.0 if step >= START else 1.0)
    record = _fit(tmp_path, model, accumulate_grad_batches=4)
    alarm = record[0].message.alarm
    assert alarm.rule == "diverging"
    # the micro-batches of the step it was confirmed at, 4 a step
    losses = model.losses[4 * alarm.step : 4 * alarm.step + 4]
    quoted = [x for x in losses if math.isclose(alarm.value, x, rel_tol=1e-5)]
    assert quoted, (alarm.value, losses)
    assert f"this step's loss {alarm.value:.4g}" in str(alarm.message)


def test_a_divergence_that_raises_is_in_the_event_files_and_fails_the_gate(
    tmp_path: Path,
) -> None:
    """Under ``on_alarm="raise"`` the fit ends at the confirmation; its count and its text are
    written and saved first, so ``lightning-hooks report --fail-on`` fails the run."""
    from lightning_hooks import TrainingAlarmError
    from lightning_hooks.cli import main

    model = ScaledLoss(lambda step: 3.0 if step >= START else 1.0)
    with pytest.raises(TrainingAlarmError, match=r"GradFlowCallback \[diverging\]: loss diverg"):
        _fit(tmp_path, model, callback=GradFlowCallback(on_alarm="raise"))
    assert len(model.losses) < STEPS
    counts = read_scalars(tmp_path)["grad_flow/alarms_step/diverging"]
    assert sum(v for _, v in counts) >= 1
    assert "loss diverging at optimizer step" in "\n".join(read_alarm_texts(tmp_path))
    rule = "grad_flow/alarms/diverging>0"
    assert main(["report", str(tmp_path), "--fail-on", rule]) == 1
