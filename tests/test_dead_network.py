"""A network a too-high learning rate killed says what happened: the layer, since when, the run's
learning rate in the fix, the loss since then against ``ln C``, and the loss's jump before it.
Deterministic: the layer is killed by a bias set to -1e3 before a ReLU, not by a chaotic run."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import GradFlowCallback, TrainingAlarmWarning
from lightning_hooks.core import AlarmRules, TrainingAlarms
from lightning_hooks.core.alarms import RunFacts
from lightning_hooks.core.alarms.gradients import DEAD_STEPS

from conftest import read_alarm_texts

KILL = 30  # the step the second ReLU stops firing for good
CLASSES = 4


class Classifier(pl.LightningModule):
    """8 -> 16 -> ReLU -> 16 -> ReLU -> 4 classes, cross-entropy on balanced labels, SGD 0.1."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, CLASSES)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(8 * 60, 8, generator=g)
        y = torch.arange(8 * 60) % CLASSES  # balanced: a uniform guess is the best constant
        return DataLoader(TensorDataset(x, y), batch_size=8)


class Kill(pl.Callback):
    """Sets ``net.2``'s bias to -1e3 at optimizer step :data:`KILL`: the ReLU after it never
    fires again, so ``net.2`` and ``net.0`` get exactly zero gradient, and ``net.4`` its bias's."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == KILL:
            with torch.no_grad():
                pl_module.net[2].bias.fill_(-1e3)


def test_a_dead_network_names_the_learning_rate_and_the_loss_at_chance(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        callbacks=[Kill(), GradFlowCallback()],
        max_steps=KILL + 20,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=10,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(Classifier())
    warned = [w.message for w in record if issubclass(w.category, TrainingAlarmWarning)]
    assert len(warned) == 1, [str(m) for m in warned]
    alarm = warned[0].alarm  # type: ignore[union-attr]
    assert (alarm.rule, alarm.layer, alarm.step) == ("vanishing", "net.2", KILL + DEAD_STEPS - 1)
    first, *details = alarm.message.splitlines()
    assert first == (
        f"dead network at optimizer step {KILL + DEAD_STEPS - 1}: net.2 and every layer before "
        f"it get no gradient since step {KILL}; fix: lower the learning rate (10x)"
    )
    assert len(first) <= 160
    assert details[0] == "the learning rate is 0.1; 0.01, 10x lower, is the usual first step"
    chance = f"ln {CLASSES} = {math.log(CLASSES):.4g}, a uniform guess over the output layer's"
    (story,) = [line for line in details if line.startswith(f"the loss since step {KILL}:")]
    assert chance in story and story.endswith("the network has stopped learning"), story
    assert not [line for line in details if "jumped" in line]  # no jump came before it
    texts = read_alarm_texts(tmp_path / "lightning_logs" / "version_0")
    assert sum(first in text for text in texts) == 2  # its logging step's text, the epoch's


def test_the_loss_jump_before_a_death_is_told() -> None:
    """On the rules alone: a loss of 2.3, one step at 30, then flat at ln 10 while the first
    layer gets exactly zero gradient from step 12 on."""
    alarms = TrainingAlarms(["a", "b", "global"], AlarmRules())
    alarms.set_run_facts(RunFacts(read_learning_rate=lambda: 0.5, classes=10))
    losses = [2.3] * 10 + [30.0] + [math.log(10)] * 20
    for step, loss in enumerate(losses):
        first = 0.0 if step >= 12 else 1.0
        alarms.update(torch.tensor([first, 1.0, math.hypot(first, 1.0)]), step=step)
        alarms.update_loss(torch.tensor(loss), step=step)
    dead = [a for a in alarms.log if a.network_cut]
    assert [(a.layer, a.step) for a in dead] == [("a", 12 + DEAD_STEPS - 1)]
    message = dead[0].message
    assert "before it, the loss jumped to 30 at step 10 (the run started at 2.3)" in message
    assert message.splitlines()[1].startswith("the learning rate is 0.5; 0.05, 10x lower")
    assert "at ln 10 = 2.303" in message
