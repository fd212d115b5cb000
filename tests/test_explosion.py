"""The *explosion* and *stall* warnings through ``Trainer.fit`` on real data (scikit-learn's
digits), at every default of ``GradFlowCallback()``: a 6-layer MLP under Adam
whose gradient is multiplied by 1e6 at step 37, is warned at its step naming a layer, with a
clip value in the advice; the same under ``gradient_clip_val=1.0`` is not warned; the stall that
follows it (Adam's second moment poisoned) is warned within a logging interval of its onset,
and a schedule decaying the learning rate to zero is not; a healthy RMSprop run is not warned.
Counts are read back from the TensorBoard event files."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import AlarmRules, GradFlowCallback
from lightning_hooks.errors import TrainingAlarmWarning
from lightning_hooks.tags import NOTICES

from conftest import fit_alarms, read_scalars

BOOM = 37  # an early step


class Digits6(pl.LightningModule):
    """A 6-layer MLP on the digits; the gradient times ``explode`` at step ``at``."""

    def __init__(
        self, optimizer: str = "adam", explode: float = 1.0, at: int = BOOM, decay: int = 0
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(5):
            layers += [nn.Linear(64, 64), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(64, 10))
        self.optimizer, self.explode, self.at, self.decay = optimizer, explode, at, decay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def on_after_backward(self) -> None:
        if self.trainer.global_step == self.at:  # a bad batch: the gradient blows up
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.explode)

    def configure_optimizers(self) -> Any:
        if self.optimizer == "rmsprop":
            return torch.optim.RMSprop(self.parameters(), lr=1e-3)
        opt = torch.optim.Adam(self.parameters(), lr=1e-3)
        if not self.decay:
            return opt
        # linear decay to exactly zero at step ``decay``, then zero
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1.0 - s / self.decay))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[Any]:
        from sklearn.datasets import load_digits

        data = load_digits()
        g = torch.Generator().manual_seed(0)
        idx = torch.randint(0, len(data.target), (200 * 32,), generator=g)
        x = torch.tensor(data.data, dtype=torch.float32)[idx] / 16.0
        return DataLoader(TensorDataset(x, torch.tensor(data.target)[idx]), batch_size=32)


def _fit(
    tmp_path: Path,
    model: Digits6,
    steps: int,
    rules: AlarmRules | None = None,
    on_alarm: Any = "warn",
    **kwargs: Any,
) -> tuple[list[TrainingAlarmWarning], dict[str, list[tuple[int, float]]]]:
    torch.manual_seed(0)
    callback = GradFlowCallback(alarms=AlarmRules() if rules is None else rules, on_alarm=on_alarm)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        max_steps=steps,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        **kwargs,
    )
    found = [w.message for w in fit_alarms(trainer, model)]
    return found, read_scalars(tmp_path)  # type: ignore[return-value]


def _epoch_count(scalars: dict[str, list[tuple[int, float]]], rule: str) -> float:
    """The last epoch's count of ``rule``: a notice's (spike, stall) at the default on_alarm."""
    kind = "notices" if rule in NOTICES else "alarms"
    return scalars[f"grad_flow/{kind}/{rule}"][-1][1]


def test_adam_explosion_is_warned_at_its_step(tmp_path: Path) -> None:
    found, scalars = _fit(tmp_path, Digits6(explode=1e6), steps=150)
    boom = [w.alarm for w in found if w.alarm.rule == "explosion"]  # type: ignore[attr-defined]
    assert [a.step for a in boom] == [BOOM]
    assert boom[0].layer.startswith("net.")  # a layer is named
    assert boom[0].value / boom[0].reference > 1e4
    clip = re.search(r"gradient_clip_val=([0-9.e+-]+)", str(boom[0].message))
    assert clip is not None
    # the advised clip is a few times the global norm's scale: the explosion would be harmless
    assert 0.0 < float(clip.group(1)) < boom[0].value / 1e4
    assert "on_alarm={'explosion': 'skip'}" in str(boom[0].message)
    assert _epoch_count(scalars, "explosion") >= 1.0
    # the poisoned second moment shrinks every update, but the loss still falls: a
    # run that learns is not stalled
    assert [w for w in found if w.alarm.rule == "stall"] == []  # type: ignore[attr-defined]
    assert _epoch_count(scalars, "stall") == 0.0


def test_the_update_collapse_after_it_is_a_stall_without_the_loss_gate(tmp_path: Path) -> None:
    """With ``stall_progress=1`` (the update alone decides, as in 0.1.0) the same run has
    a ``stall`` at the next logging step after the explosion's own momentum has died out (about
    step 80): 99. Under the default ``on_alarm`` it is logged (counted), not warned: the
    explosion was warned at its step; ``on_alarm={"stall": "warn"}`` warns it."""
    rules = AlarmRules(stall_progress=1.0)
    found, scalars = _fit(tmp_path / "log", Digits6(explode=1e6), steps=150, rules=rules)
    assert [w.alarm.rule for w in found] == ["explosion"]  # type: ignore[attr-defined]
    assert _epoch_count(scalars, "stall") >= 1.0
    on = {"stall": "warn"}
    found, _ = _fit(tmp_path / "warn", Digits6(explode=1e6), steps=150, rules=rules, on_alarm=on)
    stall = [w.alarm for w in found if w.alarm.rule == "stall"]  # type: ignore[attr-defined]
    assert [a.step for a in stall] == [99]
    assert stall[0].reference / stall[0].value > 100.0


def test_the_same_explosion_under_clipping_is_logged_not_warned(tmp_path: Path) -> None:
    found, scalars = _fit(tmp_path, Digits6(explode=1e6), steps=150, gradient_clip_val=1.0)
    assert found == []
    assert _epoch_count(scalars, "spike") >= 1.0  # logged: it is in TensorBoard
    assert _epoch_count(scalars, "explosion") == 0.0


def test_a_schedule_decaying_the_lr_to_zero_is_not_a_stall(tmp_path: Path) -> None:
    found, scalars = _fit(tmp_path, Digits6(decay=120), steps=200, log_every_n_steps=10)
    assert found == []
    assert _epoch_count(scalars, "stall") == 0.0


def test_a_healthy_rmsprop_run_is_not_warned(tmp_path: Path) -> None:
    found, scalars = _fit(tmp_path, Digits6(optimizer="rmsprop"), steps=200)
    assert found == []
    assert all(_epoch_count(scalars, r) == 0.0 for r in ("explosion", "stall", "diverging"))
