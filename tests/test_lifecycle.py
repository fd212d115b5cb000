"""The lifecycle every callback holds, driven by hand as a callback's hooks drive it.

A stand-in trainer steps by hand, so each test says exactly which batch belongs to which
optimizer step; the callbacks' own tests drive the same lifecycle through ``Trainer.fit``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pytorch_lightning.loggers import CSVLogger
from torch import nn

from lightning_hooks.callbacks.attached import Logged
from lightning_hooks.callbacks.lifecycle import Lifecycle
from lightning_hooks.callbacks.watching import attach_stats
from lightning_hooks.core.hooks.guard import Guard
from lightning_hooks.core.stats.dead_units import DeadUnits, DeadUnitTracker
from lightning_hooks.errors import LightningHooksWarning


def _trainer(tmp_path: Path) -> SimpleNamespace:
    """A single-device trainer with one logger, at optimizer step 0."""
    return SimpleNamespace(
        strategy=object(),
        loggers=[CSVLogger(tmp_path)],
        global_step=0,
        current_epoch=0,
        log_every_n_steps=50,
        is_global_zero=True,
    )


def _started(
    tmp_path: Path, written: list[int], *, strict: bool = True
) -> tuple[Lifecycle, SimpleNamespace, nn.Module]:
    """A lifecycle that watches a small ReLU model every 2 steps, attached for a fit.

    A ``strict`` guard raises a failure; another disables the callback for the rest of the fit.
    """
    guard = Guard("Watcher", strict=strict)
    lifecycle = Lifecycle("Watcher", guard, every_n_steps=2, uses_images=False)
    trainer = _trainer(tmp_path)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    lifecycle.start_fit(trainer, guard, watching=True)
    assert lifecycle.start_training()

    def record(trainer: Any, step: int, result: DeadUnits) -> None:
        written.append(step)

    tracker = DeadUnitTracker()
    logged = [Logged(tracker, on_step=record)]
    lifecycle.attach(attach_stats(model, lifecycle.guard, logged))
    return lifecycle, trainer, model


def _one_step(lifecycle: Lifecycle, trainer: SimpleNamespace, model: nn.Module) -> bool:
    """Run one batch of one optimizer step; return whether the lifecycle measured it."""
    measured = lifecycle.start_batch(trainer, batch_idx=trainer.global_step)
    model(torch.randn(3, 4))
    trainer.global_step += 1  # the optimizer stepped
    lifecycle.end_batch(trainer)
    return measured


def test_each_logging_step_is_written_once_after_its_optimizer_step(tmp_path: Path) -> None:
    """Steps 0 (the epoch's first), 1 and 3 are logging steps at every 2 steps; each is written
    once, at the end of its own batch, and step 2 runs none of the hooks."""
    written: list[int] = []
    lifecycle, trainer, model = _started(tmp_path, written)
    measured = [_one_step(lifecycle, trainer, model) for _ in range(4)]
    assert measured == [True, True, False, True]
    assert written == [0, 1, 3]
    lifecycle.end_training(trainer)
    assert lifecycle.attached is None


def test_the_end_of_training_takes_the_hooks_off_once(tmp_path: Path) -> None:
    """After the end of training the model runs none of the hooks, the next batch measures
    nothing, and a second removal does nothing."""
    written: list[int] = []
    lifecycle, trainer, model = _started(tmp_path, written)
    attached = lifecycle.attached
    assert attached is not None
    assert attached.registry is not None
    _one_step(lifecycle, trainer, model)
    lifecycle.end_training(trainer)
    assert len(attached.registry) == 0
    lifecycle.remove_hooks()
    assert not _one_step(lifecycle, trainer, model)
    assert written == [0]


def test_a_callback_standing_aside_attaches_nothing(tmp_path: Path) -> None:
    """A fit started without watching (the user's own callback of the class watches) tells its
    callback not to attach, and measures no batch."""
    guard = Guard("Watcher", strict=True)
    lifecycle = Lifecycle("Watcher", guard, every_n_steps=1, uses_images=False)
    trainer = _trainer(tmp_path)
    lifecycle.start_fit(trainer, guard, watching=False)
    assert not lifecycle.start_training()
    assert not lifecycle.start_batch(trainer, batch_idx=0)
    assert lifecycle.attached is None


def test_a_failed_batch_writes_nothing_of_its_logging_step(tmp_path: Path) -> None:
    """A failure in a batch's hooks (one process: the guard disables at once) leaves its
    logging step unwritten; the steps before it were written."""
    written: list[int] = []
    lifecycle, trainer, model = _started(tmp_path, written, strict=False)
    _one_step(lifecycle, trainer, model)  # step 0, written
    assert lifecycle.start_batch(trainer, batch_idx=1)  # step 1, a logging step
    model(torch.randn(3, 4))
    with pytest.warns(LightningHooksWarning, match="Watcher is disabled"):
        lifecycle.guard.fail("forward hook", RuntimeError("boom"))
    trainer.global_step += 1
    lifecycle.end_batch(trainer)
    assert written == [0]


def test_a_batch_is_measured_only_once_the_fit_has_attached(tmp_path: Path) -> None:
    """Before the fit attaches (or after its hooks came off), even a logging step is not
    measured; each fit's cadence starts afresh."""
    guard = Guard("Watcher", strict=True)
    lifecycle = Lifecycle("Watcher", guard, every_n_steps=1, uses_images=False)
    trainer = _trainer(tmp_path)
    lifecycle.start_fit(trainer, guard, watching=True)
    first = lifecycle.cadence
    assert lifecycle.start_training()
    assert not lifecycle.start_batch(trainer, batch_idx=0)
    assert not lifecycle.measuring
    lifecycle.start_fit(trainer, Guard("Watcher", strict=True), watching=True)
    assert lifecycle.cadence is not first
