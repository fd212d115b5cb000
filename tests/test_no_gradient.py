"""A trainable layer that gets no gradient is a notice, once per fit, never a warning: through a
real ``Trainer.fit``, read back from the event files and ``lightning-hooks report``; and on the
rules alone, what tells it from a dead network."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_hooks import GradFlowCallback
from lightning_hooks.cli import main
from lightning_hooks.core import AlarmRules, TrainingAlarms
from lightning_hooks.core.alarms.gradients import DEAD_STEPS
from lightning_hooks.report import format_table, read_run
from lightning_hooks.tags import NOTICES, SPIKE_SCORE

from conftest import epoch_end_step, read_alarm_texts, read_scalars
from support import LongMLP

NOTICE = "aux_head got no gradient in 20 optimizer steps (to step 19): is it used in forward?"


class AuxHead(LongMLP):
    """LongMLP with an ``aux_head`` defined and never called in ``forward``, and a frozen layer
    (``requires_grad=False``) that is."""

    def __init__(self) -> None:
        super().__init__(batches=40)
        self.aux_head = nn.Linear(16, 1)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x + self.frozen(x))  # type: ignore[no-any-return]


def test_a_layer_never_called_in_forward_is_one_notice_and_a_marked_row(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        callbacks=[GradFlowCallback()],
        max_steps=45,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=30,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(AuxHead())
    said = [str(w.message) for w in record if issubclass(w.category, UserWarning)]
    assert not [m for m in said if "aux_head" in m or "frozen" in m or "GradFlow" in m], said
    logdir = tmp_path / "lightning_logs" / "version_0"
    texts = read_alarm_texts(logdir)
    # the logging step's text, the first epoch's, the second epoch's: once per fit
    assert [text.count(NOTICE) for text in texts] == [1, 1, 0]
    assert "- step 19, no_gradient (notice), aux_head:" in texts[0]
    assert not any(", frozen:" in text for text in texts)  # no alarm names it
    scalars = read_scalars(logdir)
    epochs = {epoch_end_step(40): 1.0, epoch_end_step(45): 0.0}  # epochs of 40 and 5 steps
    assert dict(scalars[NOTICES["no_gradient"].tag]) == epochs
    assert sum(v for _, v in scalars["grad_flow/notices_step/no_gradient"]) == 1.0
    warned = [t for t in scalars if t.startswith("grad_flow/alarms/") and t != SPIKE_SCORE]
    assert not [tag for tag in warned if any(v for _, v in scalars[tag])]
    report = read_run(logdir, tmp_path)
    assert report is not None
    (marked,) = [row.layer for row in report.layers if row.no_gradient]
    assert marked == "aux_head"
    table = format_table(report)
    row = next(line for line in table.splitlines() if line.startswith("aux_head"))
    assert row.split()[:5] == ["aux_head", "(no", "gradient)", "-", "-"]  # no update ratio of 0
    assert "notices: no_gradient_layers=1" in table
    assert report.to_json()["layers"][0] == {**report.to_json()["layers"][0], "no_gradient": True}
    # the recommended gate passes; a gate on the notice, which a user may ask for, fails
    assert main(["report", str(logdir), "--fail-on", "warnings>0"]) == 0
    assert main(["report", str(logdir), "--fail-on", "no_gradient_layers>0"]) == 1


def _replay(
    norms: list[float], steps: int, stepped: list[bool] | None = None, rows: list[int] | None = None
) -> TrainingAlarms:
    """The alarms at their defaults after ``steps`` steps of the same layer ``norms`` (the
    global row last)."""
    alarms = TrainingAlarms(["a", "b", "c", "d", "global"], AlarmRules(diverge_ratio=None))
    for step in range(steps):
        alarms.update(
            torch.tensor(norms),
            rows,
            step=step,
            stepped=None if stepped is None else torch.tensor(stepped),
        )
    return alarms


def test_an_idle_expert_between_live_layers_is_a_notice_and_a_dead_prefix_a_warning() -> None:
    idle = _replay([1.0, 0.0, 0.0, 2.0, 2.3], 60)
    assert [(a.rule, a.layer, a.others, a.step) for a in idle.log] == [
        ("no_gradient", "b", ("c",), 19)
    ]
    dead = _replay([0.0, 0.0, 1.0, 2.0, 2.3], 60)
    assert [(a.rule, a.layer, a.step) for a in dead.log] == [("vanishing", "b", DEAD_STEPS - 1)]
    assert dead.counts["no_gradient"] == 0  # its layers are the dead network's, named once


def test_a_layer_the_optimizer_does_not_hold_is_never_named() -> None:
    """A frozen layer is no row of the optimizer's (``rows``); an unused one is held, its
    gradient missing (``stepped``)."""
    unused = _replay([1.0, 0.0, 1.5, 2.0, 2.3], 30, stepped=[True, False, True, True, True])
    assert [(a.rule, a.layer) for a in unused.log] == [("no_gradient", "b")]
    frozen = _replay([1.0, 1.5, 2.0, 2.3], 30, rows=[0, 2, 3, 4])
    assert frozen.log == []


def test_a_small_gradient_warns_vanishing_where_it_starves_the_first_layers() -> None:
    """A tiny gradient on the first layers, a later one live: the gradient vanishes before it
    reaches the bottom of the network, and *vanishing* warns. A tiny layer with a live one
    before it: the gradient goes around it (a residual block, a branch), a notice."""
    first = _replay([1e-6, 1.0, 1.5, 2.0, 2.3], 30)
    assert [(a.rule, a.layer, a.step) for a in first.log] == [("vanishing", "a", 19)]
    middle = _replay([1.0, 1e-6, 1.5, 2.0, 2.3], 30)
    assert [(a.rule, a.layer, a.step) for a in middle.log] == [("no_gradient", "b", 19)]
    assert middle.log[0].message.startswith(
        "b got next to no gradient in 20 optimizer steps (to step 19), while a layer before it "
        "gets one: is it bypassed?"
    )


class Residual(LongMLP):
    """``inp``, a residual ``block`` added to its output, then ``head``."""

    def __init__(self) -> None:
        super().__init__(batches=40)
        del self.net
        self.inp = nn.Linear(8, 16)
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.head(h + self.block(h))  # type: ignore[no-any-return]


class Shrink(pl.Callback):
    """Scales ``block``'s gradients by 1e-6 after every backward: next to none reaches it."""

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for p in pl_module.block.parameters():
            assert p.grad is not None
            p.grad.mul_(1e-6)


def test_a_layer_the_gradient_flows_around_is_a_notice(tmp_path: Path) -> None:
    """A residual block whose gradient is a millionth of its neighbours', ``inp`` before it
    still getting its own: bypassed, one notice; no *vanishing* warning."""
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        callbacks=[Shrink(), GradFlowCallback()],
        max_steps=30,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=30,
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.fit(Residual())
    said = [str(w.message) for w in record if "GradFlowCallback" in str(w.message)]
    assert said == []
    texts = read_alarm_texts(tmp_path / "lightning_logs" / "version_0")
    notice = (
        "block got next to no gradient in 20 optimizer steps (to step 19), while a layer "
        "before it gets one: is it bypassed?"
    )
    assert [text.count(notice) for text in texts] == [1, 1]  # the logging step's, the epoch's
    scalars = read_scalars(tmp_path / "lightning_logs" / "version_0")
    assert dict(scalars[NOTICES["no_gradient"].tag]) == {epoch_end_step(30): 1.0}
    assert sum(v for _, v in scalars["grad_flow/alarms/vanishing"]) == 0
