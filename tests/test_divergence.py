"""The *diverging* warning through ``Trainer.fit`` on real data (scikit-learn's digits): an early
blow-up is warned at its step, a slow drift before the loss is back at chance, a healthy Adam run
not at all; the spike score is logged. Each expected step is computed here from the losses the
model saw, by the ground truth of ``benchmarks/divergence.py`` and the rule written in numpy."""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import GradFlowCallback
from lightning_hooks.core import AlarmRules
from lightning_hooks.errors import TrainingAlarmWarning

from conftest import fit_alarms, load_benchmark, read_alarm_texts, read_scalars

CHANCE = math.log(10)
IN_TIME = 3  # a warning on confirmation is in time this many steps after the divergence step


class Digits(pl.LightningModule):
    """64 -> 32 -> 10 on scikit-learn's digits; Adam, an optional linear LR ramp."""

    def __init__(self, lr: float, ramp: int = 0, steps: int = 40) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.lr, self.ramp, self.steps = lr, ramp, steps
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.losses.append(float(loss))  # the test's own record: a sync is fine here
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        if not self.ramp:
            return opt
        ramp = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / self.ramp)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": ramp, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[Any]:
        from sklearn.datasets import load_digits

        data = load_digits()
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(0, len(data.target), (self.steps * 32,), generator=g)
        x = torch.tensor(data.data, dtype=torch.float32)[idx] / 16.0
        y = torch.tensor(data.target)[idx]
        return DataLoader(TensorDataset(x, y), batch_size=32)


def _fit(tmp_path: Path, model: Digits) -> list[warnings.WarningMessage]:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        callbacks=[GradFlowCallback()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        log_every_n_steps=10,
    )
    return fit_alarms(trainer, model)


def _ground_truth(losses: list[float]) -> int | None:
    """benchmarks/divergence.py's divergence step, written again (a rise the run recovers
    from, its last 50 losses below half its first, is not one)."""
    step = _first_rise(losses)
    tail = float(np.mean(losses[-50:]))
    if step is not None and math.isfinite(tail) and tail < 0.5 * losses[0]:
        return None
    return step


def _first_rise(losses: list[float]) -> int | None:
    best = math.inf
    for step in range(len(losses)):
        if not math.isfinite(losses[step]):
            return step
        mean = float(np.mean(losses[max(0, step - 4) : step + 1]))
        best = min(best, mean)
        if mean >= 2 * best and mean - best >= 0.5 * max(losses[0] - best, 0.0):
            return step
    return None


def _rule(losses: list[float], rules: AlarmRules, adaptive: bool = False) -> list[int]:
    """Steps where *diverging* warns, in plain Python, written from the rule's documentation:
    a *setback* opens when the short running mean (span ``diverge_span``) rises over the best
    of the noise-lengthened level by the ratio bar (``diverge_overshoot`` over the first
    ``diverge_early`` losses of an ``adaptive`` optimizer's run) and the giveback bar (of what
    was learnt since the start, the mean of the first ``min_history`` losses), plus the noise
    bar (``diverge_noise`` spreads of the short mean, from the mean step-to-step jump, armed
    from ``min_history`` losses). It is confirmed, and warns while it is open, once
    ``diverge_patience`` of its losses are over the bar themselves, or once the median of its
    last ``2 * diverge_patience - 1`` losses passes ``diverge_lost`` x the start (known once
    ``min_history`` losses are in). Over the first
    ``min_history`` losses the best is the level, their mean. The jitter and the level hold
    still while a setback is open."""
    assert rules.diverge_ratio is not None
    span = rules.diverge_span
    alpha = 2.0 / (span + 1)
    mean = level = best = first = last = losses[0]
    jitter = 0.0
    fired: list[int] = []
    held, confirmed, opened = 0, False, False
    recent = 2 * rules.diverge_patience - 1
    for n, loss in enumerate(losses[1:], start=2):  # n: losses seen, this one included
        step = n - 1
        mean += max(alpha, 1.0 / n) * (loss - mean)
        median = float(np.median(losses[max(0, n - recent) : n]))
        sigma = jitter / (2.0 / math.sqrt(math.pi))
        spread = sigma * math.sqrt(alpha / (2.0 - alpha))
        noise = rules.diverge_noise * spread if n >= rules.min_history else 0.0
        early = adaptive and n <= rules.diverge_early
        ratio = rules.diverge_overshoot if early else rules.diverge_ratio
        bar = best + max((ratio - 1) * abs(best), rules.diverge_giveback * max(first - best, 0.0))
        bar += noise
        if mean > bar:
            held += loss > bar
            lost = n > rules.min_history and median > rules.diverge_lost * first + noise
            confirmed = confirmed or lost or held >= rules.diverge_patience
            if confirmed:
                fired.append(step)
            opened = True
        else:
            held, confirmed, opened = 0, False, False
        if not opened:
            jitter += (abs(loss - last) - jitter) / min(n - 1, 64)
            sigma = jitter / (2.0 / math.sqrt(math.pi))
            relative = sigma / abs(level) if level else 0.0
            level_span = min(max(float(span), (relative / 0.1) ** 2), 128.0)
            level += max(2.0 / (level_span + 1), 1.0 / n) * (loss - level)
            best = level if n <= rules.min_history else min(best, level)
            if n <= rules.min_history:
                first += (loss - first) / n
        last = loss
    return fired


def _steps(record: list[warnings.WarningMessage]) -> list[int]:
    return [w.message.alarm.step for w in record if "diverging" in str(w.message)]  # type: ignore[union-attr]


def test_an_early_blow_up_is_warned_in_time(tmp_path: Path) -> None:
    """A blow-up in the first steps is warned on confirmation within ``IN_TIME`` steps of its
    divergence step."""
    model = Digits(lr=1.0, steps=12)
    record = _fit(tmp_path, model)
    diverged = _ground_truth(model.losses)
    assert diverged is not None and diverged < 5, model.losses  # a blow-up in the first steps
    warned = _steps(record)
    assert warned and warned[0] == _rule(model.losses, AlarmRules())[0] <= diverged + IN_TIME
    message = str(record[0].message)
    assert re.search(r"loss diverging at optimizer step \d+: its running mean", message)
    assert "fix: lower the learning rate" in message.splitlines()[0]
    # the spike score: every alarm (one-step spikes included) per 1,000 steps of the fit
    texts = read_alarm_texts(tmp_path)
    counted = re.match(r"(\d+) warnings and (\d+) notices", texts[-1])
    assert counted is not None
    alarms = int(counted.group(1)) + int(counted.group(2))
    (score,) = [v for _, v in read_scalars(tmp_path)["grad_flow/alarms/spike_score"]]
    assert score == pytest.approx(1000.0 * alarms / len(model.losses))


def test_a_slow_drift_is_warned_before_the_loss_is_back_at_chance(tmp_path: Path) -> None:
    """A rising learning rate undoes what the run learnt: warned before its loss is back at
    chance."""
    model = Digits(lr=0.5, ramp=150, steps=150)  # learns, then the rising LR undoes it
    record = _fit(tmp_path, model)
    losses = model.losses
    diverged = _ground_truth(losses)
    assert diverged is not None and diverged > 20, losses  # after a healthy start
    means = [float(np.mean(losses[max(0, s - 4) : s + 1])) for s in range(len(losses))]
    at_chance = next(s for s in range(diverged, len(losses)) if means[s] >= 0.9 * CHANCE)
    warned = _steps(record)
    assert warned, losses
    # a rise is warned once it is confirmed (the shorter ones it crosses first are setbacks
    # that recover): after its divergence step, before it is back at chance
    assert warned[0] == _rule(losses, AlarmRules())[0] < at_chance


def test_a_healthy_adam_run_raises_no_alarm(tmp_path: Path) -> None:
    model = Digits(lr=1e-3, steps=60)
    record = _fit(tmp_path, model)
    assert _ground_truth(model.losses) is None
    assert model.losses[-1] < model.losses[0]
    assert record == []
    assert _rule(model.losses, AlarmRules()) == []


class BenchmarkRecipe(pl.LightningModule):
    """A recipe of ``benchmarks/divergence.py`` through ``Trainer.fit``: its model, seed, data
    and optimizer (the clip is the Trainer's ``gradient_clip_val``)."""

    def __init__(self, model: str, optimizer: str, lr: float, seed: int, steps: int) -> None:
        super().__init__()
        bench = load_benchmark("divergence")
        self.recipe = bench.Run(model, optimizer, lr, seed=seed)
        torch.manual_seed(seed)
        self.net = bench.BUILD[model]()
        batches = bench._batches(self.recipe, torch.Generator().manual_seed(seed))
        self.batches = [next(batches) for _ in range(steps)]
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self.net(x)
        loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        self.losses.append(float(loss))  # the test's own record
        return loss

    def configure_optimizers(self) -> Any:
        return load_benchmark("divergence")._optimizer(self.recipe, self.net)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.batches, batch_size=None)  # type: ignore[arg-type]


def _fit_recipe(
    tmp_path: Path, model: BenchmarkRecipe, clip: float | None = 1.0
) -> list[warnings.WarningMessage]:
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        accelerator="cpu",
        gradient_clip_val=clip,
        callbacks=[GradFlowCallback()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    return fit_alarms(trainer, model)


def test_a_blow_up_in_the_first_steps_is_not_hidden_by_its_own_swing(tmp_path: Path) -> None:
    """The benchmark's LSTM on SGD at 30 (seed 0), unclipped: its loss more than doubles by
    step 2. The noise is measured from one loss to the next before that step, so the blow-up's
    own swing is not the bar: warned in time, the median of its last steps' losses past
    ``diverge_lost`` x the start, without waiting for ``diverge_patience``."""
    model = BenchmarkRecipe("lstm", "sgd", 30.0, seed=0, steps=12)
    record = _fit_recipe(tmp_path, model, clip=None)
    diverged = _ground_truth(model.losses)
    assert diverged is not None and diverged <= 3, model.losses
    warned = _steps(record)
    assert warned and warned[0] == _rule(model.losses, AlarmRules())[0] <= diverged + IN_TIME
    assert "past diverge_lost=1.5x" in str(record[0].message)


def test_an_rmsprop_overshoot_that_recovers_is_not_warned(tmp_path: Path) -> None:
    """The benchmark's LSTM on RMSprop at 0.1 with clipping (seed 0): RMSprop's first
    update is 10x its learning rate per coordinate, the loss doubles at step 1 and triples at
    step 2, then the run learns (its last 50 losses under half its first). At step 2 it cannot
    be told from a lost run; an adaptive optimizer's first ``diverge_early`` losses are held to
    the ``diverge_overshoot`` bar, and nothing is warned."""
    model = BenchmarkRecipe("lstm", "rmsprop", 0.1, seed=0, steps=120)
    record = _fit_recipe(tmp_path, model)
    assert max(model.losses[1:3]) > 2.0 * model.losses[0], model.losses[:4]  # the overshoot
    assert np.mean(model.losses[-50:]) < 0.5 * model.losses[0]  # ... that recovers
    assert _ground_truth(model.losses) is None
    assert record == []
    assert _rule(model.losses, AlarmRules(), adaptive=True) == []


def test_an_rmsprop_blow_up_that_is_lost_is_warned_in_time(tmp_path: Path) -> None:
    """The benchmark's 6-layer MLP on RMSprop at 0.03 (seed 0): a thousandfold loss at step 1
    that the run never recovers from clears the overshoot bar. It is warned at step 3, once the
    run's start (the mean of its first ``min_history`` losses) is known and the median of its
    last steps' losses is past ``diverge_lost`` times it: in time."""
    model = BenchmarkRecipe("mlp6", "rmsprop", 0.03, seed=0, steps=6)
    record = _fit_recipe(tmp_path, model)
    assert _first_rise(model.losses) == 1, model.losses
    assert _steps(record)[:1] == [AlarmRules().min_history]
    assert "past diverge_lost" in str(record[0].message)


def test_a_healthy_rmsprop_overshoot_in_the_first_steps_is_not_warned(tmp_path: Path) -> None:
    """The same LSTM at 0.01: RMSprop's first steps overshoot (the loss rises again at step 2)
    before it learns; nothing is warned."""
    model = BenchmarkRecipe("lstm", "rmsprop", 0.01, seed=2, steps=60)
    record = _fit_recipe(tmp_path, model)
    assert _ground_truth(model.losses) is None
    assert max(model.losses[1:4]) > model.losses[1], model.losses  # the overshoot
    assert np.mean(model.losses[-10:]) < 0.7 * model.losses[0]
    assert record == []
    assert _rule(model.losses, AlarmRules(), adaptive=True) == []


class NoisyRegressor(pl.LightningModule):
    """``examples/quickstart.py``'s model and data: the sum of 16 Gaussians, MSE, Adam at 1e-3,
    16 shuffled batches of 32 an epoch. Its per-batch loss swings 2x and it learns little in
    its first epochs: the first step's loss, low by chance, is a best that the rest exceeds."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
        )  # fmt: skip
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss))  # the test's own record
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


# Seeds where the rule before its noise bar warned (4 of the first 30; 0 of 30 with it).
@pytest.mark.parametrize("seed", [6, 13, 15, 18])
def test_a_small_noisy_run_is_not_warned(tmp_path: Path, seed: int) -> None:
    torch.manual_seed(seed)
    x = torch.randn(512, 16)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32, shuffle=True)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_epochs=3,
        accelerator="cpu",
        callbacks=[GradFlowCallback()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    model = NoisyRegressor()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(model, data)
    # healthy: the last epoch's loss is below the first's (the benchmark's ground truth, whose
    # best starts at the first step's loss, calls some of these runs divergent in their first
    # steps: that loss is low by chance)
    assert len(model.losses) == 48, model.losses
    assert np.mean(model.losses[-16:]) < np.mean(model.losses[:16]), model.losses
    assert [w for w in record if issubclass(w.category, TrainingAlarmWarning)] == []
    assert _rule(model.losses, AlarmRules()) == []


class NaNLossAt(Digits):
    """Digits whose returned loss is NaN at one step (its gradient stays the finite one)."""

    def __init__(self, step: int) -> None:
        super().__init__(lr=1e-3, steps=20)
        self.nan_step = step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if batch_idx == self.nan_step:
            loss = loss + torch.full_like(loss, math.nan)  # a constant: the gradient is loss's
        return loss


def test_a_non_finite_loss_is_warned_at_its_step_and_leaves_the_state(tmp_path: Path) -> None:
    model = NaNLossAt(step=6)
    record = _fit(tmp_path, model)
    assert len(model.losses) == 20 and all(map(math.isfinite, model.losses))  # before the NaN
    assert [str(w.message).split(";")[0] for w in record] == [
        "GradFlowCallback [diverging]: loss diverging at optimizer step 6: the loss is nan"
    ]
    # the steps after it are judged as if it had not been: the rule on the other losses is quiet
    assert _rule(model.losses[:6] + model.losses[7:], AlarmRules()) == []
