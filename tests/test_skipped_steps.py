"""``on_alarm="skip"``: the optimizer step an alarm marks leaves the weights as they were, with a
closure (Lightning's) and without one (a Fabric loop's, a GradScaler's); a stale mark is dropped.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from torch import nn

from lightning_hooks import AlarmRules, GradFlowCallback
from lightning_hooks.callbacks.grad_flow_alarms import SkippedSteps
from lightning_hooks.errors import TrainingAlarmWarning

from conftest import read_scalars


def _stepped(marked: int | None, running: int, closure: bool) -> tuple[bool, int]:
    """One SGD step of a linear layer under :class:`SkippedSteps`' pre-hook, the step
    ``running`` marked at ``marked``: whether the weights changed, and the marks left."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    trainer = SimpleNamespace(global_step=running)
    skipped = SkippedSteps(trainer)  # type: ignore[arg-type]
    optimizer.register_step_pre_hook(skipped.hook)
    if marked is not None:
        skipped.mark(optimizer, marked)
    before = layer.weight.detach().clone()

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        value = layer(torch.ones(3, 4)).pow(2).sum()
        value.backward()
        return value

    if closure:
        optimizer.step(loss)  # by position, as a plain loop passes LBFGS its closure
    else:
        loss()
        optimizer.step()
    return not torch.equal(layer.weight, before), len(skipped._marked)


def test_a_marked_step_leaves_the_weights_with_a_closure_and_without() -> None:
    """The running step marked: no change, with a closure given by position or without one."""
    assert _stepped(marked=5, running=5, closure=True) == (False, 0)
    assert _stepped(marked=5, running=5, closure=False) == (False, 0)


def test_an_unmarked_step_and_a_stale_mark_step_as_usual() -> None:
    """No mark, or a mark of an earlier step (a GradScaler skipped it): the step runs, and the
    stale mark is dropped."""
    assert _stepped(marked=None, running=5, closure=True) == (True, 0)
    assert _stepped(marked=4, running=5, closure=False) == (True, 0)


def test_skip_under_fabric_leaves_the_spiked_steps_weights(tmp_path: Path) -> None:
    """A Fabric loop (no closure): the step whose loss is read 1e6 times over passes
    ``max_grad_norm`` and is skipped, its weights as before it; the steps around it change them.
    The alarm is counted at that step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    rules = AlarmRules(max_grad_norm=1e3, diverge_ratio=None)
    callback = GradFlowCallback(alarms=rules, on_alarm="skip", every_n_steps=1)
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[callback], loggers=[logger])
    wrapped, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    changed = {}
    # every alarm it raises (spike, explosion, absolute) is of step 5
    with pytest.warns(TrainingAlarmWarning, match=r"at optimizer step 5"):
        _spiked_loop(fabric, wrapped, model, optimizer, changed)
    fabric.call("on_train_end")
    assert changed == {step: step != 5 for step in range(8)}
    counted = read_scalars(tmp_path / "tb")["grad_flow/alarms_step/absolute"]
    assert [step for step, count in counted if count > 0] == [5]


def _spiked_loop(
    fabric: Fabric,
    wrapped: nn.Module,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    changed: dict[int, bool],
) -> None:
    """Eight steps of a plain Fabric loop, the loss at step 5 read 1e6 times over; whether each
    step changed the weights."""
    for step in range(8):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(8, 8, generator=generator)
        y = torch.randn(8, 1, generator=generator)
        loss = nn.functional.mse_loss(wrapped(x), y) * (1e6 if step == 5 else 1.0)
        fabric.backward(loss)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        changed[step] = any(
            not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)
        )
