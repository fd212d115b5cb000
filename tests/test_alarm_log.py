"""What the alarms write, fit by fit: ``AlarmLog`` writes at each logging step the alarms
counted since the last, from the counts its fit's alarms were loaded with. Fed real
``TrainingAlarms``."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lightning_hooks.callbacks.alarm_actions import check_actions
from lightning_hooks.callbacks.alarm_log import AlarmLog
from lightning_hooks.core.alarms import AlarmRules, TrainingAlarm, TrainingAlarms

from conftest import MetricsOnlyLogger

NONFINITE = "grad_flow/alarms_step/nonfinite"


def _alarms(nan_at: tuple[int, ...], steps: int = 6) -> tuple[TrainingAlarms, list[TrainingAlarm]]:
    """Two layers' gradient norms over ``steps`` steps, layer ``a``'s NaN at ``nan_at``."""
    alarms = TrainingAlarms(["a", "b"], AlarmRules())
    found: list[TrainingAlarm] = []
    for step in range(steps):
        norm = math.nan if step in nan_at else 1.0
        alarms.update(torch.tensor([norm, 1.0]), step=step, clip=None)
        found += alarms.poll()
    return alarms, found


def _trainer() -> Any:  # a stand-in with the two members the log reads
    return SimpleNamespace(loggers=[MetricsOnlyLogger()], is_global_zero=True)


def _written(trainer: Any, tag: str) -> list[tuple[int, float]]:
    return [(step, metrics[tag]) for metrics, step in trainer.loggers[0].logged if tag in metrics]


def test_a_logging_step_writes_the_alarms_counted_since_the_last() -> None:
    log = AlarmLog(check_actions("warn", "GradFlowCallback"))
    trainer = _trainer()
    alarms = TrainingAlarms(["a", "b"], AlarmRules())
    log.start(alarms)
    for step in range(6):
        norm = math.nan if step in (1, 2) else 1.0
        alarms.update(torch.tensor([norm, 1.0]), step=step, clip=None)
        alarms.poll()
        if step % 2:
            log.log_step(trainer, alarms, step)
    assert _written(trainer, NONFINITE) == [(1, 1), (3, 1), (5, 0)]


def test_a_fit_counts_from_the_alarms_it_loads_never_below_them() -> None:
    """A fit whose alarms continue a checkpoint's counts (two NaN steps before it) writes only
    what comes after: at its first logging step, 0; after one more NaN step, 1."""
    saved, _ = _alarms(nan_at=(1, 2))
    loaded = TrainingAlarms(["a", "b"], AlarmRules())
    loaded.load_state_dict(saved.state_dict())
    assert loaded.counts["nonfinite"] == 2
    log = AlarmLog(check_actions("warn", "GradFlowCallback"))
    trainer = _trainer()
    log.start(loaded)
    log.log_step(trainer, loaded, 6)
    loaded.update(torch.tensor([math.nan, 1.0]), step=7, clip=None)
    loaded.poll()
    log.log_step(trainer, loaded, 7)
    assert _written(trainer, NONFINITE) == [(6, 0), (7, 1)]


def test_a_state_that_fails_part_way_leaves_the_alarms_as_they_were() -> None:
    """The running scales and the ring load before the counts fail: the error goes on, and the
    alarms hold what they held before."""
    saved, _ = _alarms(nan_at=(1,))
    alarms, _ = _alarms(nan_at=(), steps=3)
    before = alarms.state_dict()
    spoiled = {**saved.state_dict(), "counts": [0, 1]}
    with pytest.raises(TypeError):
        alarms.load_state_dict(spoiled)
    after = alarms.state_dict()
    same = {"rtol": 0.0, "atol": 0.0, "equal_nan": True}
    torch.testing.assert_close(after["scale"], before["scale"], **same)
    assert not torch.allclose(after["scale"], saved.state_dict()["scale"], equal_nan=True)
    torch.testing.assert_close(after["ring"], before["ring"], **same)
    assert after["ring_steps"] == before["ring_steps"]
    assert after["counts"] == before["counts"]
