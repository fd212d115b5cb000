"""The checkpoint slot every lifecycle holds, driven by hand.

``test_resume.py`` drives the same object through ``Trainer.fit`` and real checkpoints; these
tests pin its contract one case at a time.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_hooks.callbacks.attached import Attached, Logged
from lightning_hooks.callbacks.checkpoint import CheckpointSlot, rolls_over
from lightning_hooks.callbacks.watching import attach_stats
from lightning_hooks.core.hooks.guard import Guard
from lightning_hooks.core.stats.dead_units import DeadUnitTracker
from lightning_hooks.errors import LightningHooksWarning


class _Counter:
    """A collaborator that outlives a fit: one number, saved and loaded as it is."""

    def __init__(self, value: int) -> None:
        self.value = value

    def host_state(self) -> dict[str, Any]:
        """Return the number, for a checkpoint."""
        return {"value": self.value}

    def load_host_state(self, state: dict[str, Any]) -> None:
        """Load the number a checkpoint saved."""
        self.value = int(state["value"])


def _attached(*, measured: bool) -> Attached:
    """A fit that watches one ReLU; ``measured``: after one measured forward (its rows exist)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    attached = attach_stats(model, Guard("Watcher", strict=True), [Logged(DeadUnitTracker())])
    assert attached.registry is not None
    if measured:
        attached.registry.set_logging_step(True)
        model(torch.randn(3, 4))
    return attached


def test_one_key_keeps_one_collaborator() -> None:
    slot = CheckpointSlot("Watcher")
    slot.keep("count", _Counter(1))
    with pytest.raises(ValueError, match="already keeps 'count'"):
        slot.keep("count", _Counter(2))


def test_between_fits_only_the_kept_collaborators_are_saved() -> None:
    slot = CheckpointSlot("Watcher")
    slot.keep("count", _Counter(3))
    assert slot.save(None) == {"count": {"value": 3}}


def test_a_state_that_fits_is_loaded_whole_when_the_fit_attaches() -> None:
    """The statistics and the kept collaborator both continue from the checkpoint."""
    saved_slot = CheckpointSlot("Watcher")
    saved_slot.keep("count", _Counter(7))
    saved = saved_slot.save(_attached(measured=True))
    slot = CheckpointSlot("Watcher")
    counter = _Counter(0)
    slot.keep("count", counter)
    slot.hold(saved)
    attached = _attached(measured=False)  # a fit at its train start: nothing measured yet
    slot.restore(attached)
    assert counter.value == 7
    again = slot.save(attached)
    assert again["0:DeadUnitTracker"]["layers"] == saved["0:DeadUnitTracker"]["layers"] == ["1"]
    for name in ("fired", "calls"):
        assert torch.equal(again["0:DeadUnitTracker"][name], saved["0:DeadUnitTracker"][name])


def test_a_state_of_another_model_is_refused_whole_with_one_warning() -> None:
    """A checkpoint whose statistics belong to another model loads nothing: the kept
    collaborator keeps what it held, and the warning names the parts refused."""
    slot = CheckpointSlot("Watcher")
    counter = _Counter(5)
    slot.keep("count", counter)
    slot.hold({"0:OtherStatistic": {}, "count": {"value": 9}})
    with pytest.warns(LightningHooksWarning, match=r"none of it is loaded \(statistics, count\)"):
        slot.restore(_attached(measured=False))
    assert counter.value == 5


class _Picky(_Counter):
    """A collaborator that refuses any state: it was saved for another model."""

    def load_host_state(self, state: dict[str, Any]) -> None:
        """Refuse the state, as a collaborator does with another model's."""
        raise ValueError("saved for another model")


def test_a_part_refused_after_others_loaded_puts_each_back() -> None:
    """The statistics and the first collaborator load, then the second refuses its part: the
    first loads what it held before, and the statistics start afresh."""
    saved_slot = CheckpointSlot("Watcher")
    saved_slot.keep("count", _Counter(9))
    saved_slot.keep("picky", _Counter(1))
    saved = saved_slot.save(_attached(measured=True))
    slot = CheckpointSlot("Watcher")
    counter = _Counter(5)
    slot.keep("count", counter)
    slot.keep("picky", _Picky(0))
    slot.hold(saved)
    attached = _attached(measured=False)
    with pytest.warns(LightningHooksWarning, match="saved for another model"):
        slot.restore(attached)
    assert counter.value == 5
    calls = slot.save(attached)["0:DeadUnitTracker"]["calls"]
    assert float(calls.sum()) == 0.0


def test_a_state_of_another_epoch_rolls_over() -> None:
    """Only a state saved in an earlier epoch than the one resumed starts the epoch afresh."""
    assert not rolls_over(None, 3)  # saved between fits or by release 0.2.0: nothing to say
    assert not rolls_over(3, 3)  # saved mid-epoch: the epoch goes on
    assert rolls_over(2, 3)  # saved at epoch 2's last batch: the fit resumes at epoch 3


def test_a_new_epoch_resets_the_statistics_and_tells_each_collaborator() -> None:
    slot = CheckpointSlot("Watcher")
    told: list[str] = []
    slot.keep("count", _Counter(1), on_new_epoch=lambda: told.append("count"))
    slot.keep("other", _Counter(2))
    attached = _attached(measured=True)
    stat = attached.logged[0].stat
    assert float(stat.host_state()["calls"].sum()) == 1.0  # the measured forward
    slot.start_new_epoch(attached)
    assert told == ["count"]
    state = stat.host_state()
    assert state["layers"] == ["1"]  # its rows stay; what they counted starts afresh
    assert float(state["calls"].sum()) == 0.0
    assert float(state["counts"].sum()) == 0.0
