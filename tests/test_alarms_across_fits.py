"""The gradient flow's alarm objects, driven by hand in one process.

``LossAgreement`` reads each batch's loss for the loss rules: this rank's own, or the mean over
the ranks from one ``all_reduce`` that also carries the ranks' failures and stop requests (here
a second rank is simulated by what the ``all_reduce`` adds). ``AlarmsAcrossFits`` starts each
fit's alarms from the state the last fit or a checkpoint left, holds the running fit's, and
keeps it when the fit ends. ``test_distributed_fault_agreement.py`` and the resume tests drive
the same objects through ``Trainer.fit``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from lightning_hooks.callbacks import loss_agreement
from lightning_hooks.callbacks.alarm_actions import check_actions
from lightning_hooks.callbacks.grad_flow_alarms import AlarmsAcrossFits
from lightning_hooks.callbacks.loss_agreement import LossAgreement
from lightning_hooks.callbacks.ranks import RankAgreement
from lightning_hooks.core import GradFlowTracker
from lightning_hooks.core.alarms import AlarmRules
from lightning_hooks.core.hooks.guard import Guard
from lightning_hooks.errors import LightningHooksWarning


class _Model(nn.Module):
    """A small model that says whether Lightning optimizes it automatically."""

    def __init__(self, automatic: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = automatic
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _trainer(model: nn.Module, accumulate: int = 1) -> Any:  # the members the readers read
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return SimpleNamespace(
        accumulate_grad_batches=accumulate,
        lightning_module=model,
        optimizers=[optimizer],
        should_stop=False,
        is_global_zero=True,
        global_step=0,
        current_epoch=0,
        loggers=[],
    )


def _ranks() -> tuple[RankAgreement, list[bool]]:
    removed: list[bool] = []
    ranks = RankAgreement(Guard("GradFlowCallback", strict=False), lambda: removed.append(True))
    ranks.start()
    return ranks, removed


def _two_ranks(
    monkeypatch: pytest.MonkeyPatch, other: list[float], automatic: bool = True
) -> tuple[LossAgreement, Any, list[bool]]:
    """Return the loss agreement of this process as one of two ranks, with its trainer and the
    record of its hooks' removal; the other rank sends ``[loss, has loss, failed, stop]``."""
    monkeypatch.setattr(loss_agreement, "world_size", lambda: 2)
    added = torch.tensor(other, dtype=torch.float32)
    monkeypatch.setattr(loss_agreement, "all_reduce_sum_", lambda sums: sums.add_(added))
    model = _Model(automatic)
    ranks, removed = _ranks()
    return LossAgreement(ranks, model, AlarmRules(), "Cb"), _trainer(model), removed


def test_one_process_reads_its_own_loss_in_the_users_units() -> None:
    """One process: the rules read this rank's loss, scaled back from Lightning's division by
    ``accumulate_grad_batches``; with no loss rule, nothing is read."""
    model = _Model()
    trainer = _trainer(model, accumulate=4)
    ranks, _ = _ranks()
    agreement = LossAgreement(ranks, model, AlarmRules(), "Cb")
    assert agreement.reading == "own"
    (loss,) = agreement.losses(trainer, {"loss": torch.tensor(0.25)}, step=7) or []
    assert loss.step == 7 and float(loss.value) == 1.0
    assert agreement.losses(trainer, None, step=8) is None  # training_step returned no loss

    off = LossAgreement(ranks, model, AlarmRules(diverge_ratio=None), "Cb")
    assert off.reading == "off"
    assert off.losses(trainer, {"loss": torch.tensor(0.25)}, step=7) is None


def test_two_ranks_read_the_mean_loss_from_one_all_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks under automatic optimization: the rules read the mean of the ranks' losses."""
    agreement, trainer, removed = _two_ranks(monkeypatch, other=[3.0, 1.0, 0.0, 0.0])
    assert agreement.reading == "mean"
    (loss,) = agreement.losses(trainer, {"loss": torch.tensor(1.0)}, step=3) or []
    assert loss.step == 3 and float(loss.value) == 2.0  # (1 + 3) / 2
    assert not trainer.should_stop and not removed


def test_a_failure_on_the_other_rank_disables_the_callback_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loss's ``all_reduce`` carries the other rank's failure: this rank disables the
    callback at the same step, removes its module hooks, and hands the rules no loss."""
    agreement, trainer, removed = _two_ranks(monkeypatch, other=[3.0, 1.0, 1.0, 0.0])
    with pytest.warns(LightningHooksWarning, match="on every rank from step 5"):
        assert agreement.losses(trainer, {"loss": torch.tensor(1.0)}, step=5) is None
    assert removed == [True]


def test_a_stop_requested_on_the_other_rank_stops_this_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The other rank's stop request reaches this rank in the same ``all_reduce``."""
    agreement, trainer, _ = _two_ranks(monkeypatch, other=[3.0, 1.0, 0.0, 1.0])
    assert agreement.losses(trainer, {"loss": torch.tensor(1.0)}, step=5)
    assert trainer.should_stop


class _ArrivesABatchLate:
    """A host copy that hands back each posted value at the next post, as on CUDA."""

    def __init__(self) -> None:
        self._in_flight: tuple[Any, Any] | None = None
        self._arrived: tuple[Any, Any] | None = None

    def post(self, value: torch.Tensor, meta: Any = None) -> None:
        self._arrived = self._in_flight
        self._in_flight = (value.detach().clone().numpy(), meta)

    def read(self, wait: bool) -> tuple[Any, Any] | None:
        arrived = self._arrived
        self._arrived = None
        return arrived


def test_flags_that_arrive_a_batch_late_are_agreed_at_the_batch_that_sent_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA a batch's sums reach the host at the next batch: a failure the other rank sent
    at step 4 disables the callback at step 4, read at step 5, and the ranks count as agreed at
    step 4 only, so step 5's logging step still makes its own agreement."""
    agreement, trainer, removed = _two_ranks(monkeypatch, other=[3.0, 1.0, 1.0, 0.0])
    monkeypatch.setattr(agreement, "_sums_to_host", _ArrivesABatchLate())
    assert agreement.losses(trainer, {"loss": torch.tensor(1.0)}, step=4) == [
        (pytest.approx(2.0), 4)
    ]  # nothing has arrived yet: the mean is the device's, and no flag is read
    assert not removed
    with pytest.warns(LightningHooksWarning, match="on every rank from step 4"):
        assert agreement.losses(trainer, {"loss": torch.tensor(1.0)}, step=5) is None
    assert removed == [True]


def test_manual_optimization_turns_the_loss_rules_off_where_a_rank_has_no_loss(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under manual optimization a rank may return no loss: the mean is then unknown, so the
    loss rules turn off for the rest of the fit, with one warning that says how to keep them."""
    agreement, trainer, _ = _two_ranks(monkeypatch, other=[0.0, 0.0, 0.0, 0.0], automatic=False)
    with pytest.warns(LightningHooksWarning, match="1 of 2 ranks' training_step returned a loss"):
        assert agreement.losses(trainer, {"loss": torch.tensor(1.0)}, step=2) == []
    assert agreement.reading == "off"
    assert agreement.losses(trainer, {"loss": torch.tensor(1.0)}, step=3) is None


def _start(alarms: AlarmsAcrossFits, model: nn.Module) -> Any:
    trainer = _trainer(model)
    tracker = GradFlowTracker(model, trainer.optimizers)
    ranks, _ = _ranks()
    return alarms.start(trainer, model, tracker, ranks), tracker


def _feed(fit_alarms: Any, losses: list[float]) -> None:
    for step, value in enumerate(losses):
        fit_alarms.training_alarms.update_loss(torch.tensor(value), step=step)
    fit_alarms.training_alarms.poll(wait=True)


def test_the_alarms_carry_their_state_from_one_fit_to_the_next() -> None:
    """A fit's alarms are held as ``running`` until the fit ends; a checkpoint saves the
    running fit's state, and the next fit starts from the state the last one left."""
    model = _Model()
    alarms = AlarmsAcrossFits(AlarmRules(), check_actions("warn", "Cb"), "Cb")
    assert alarms.running is None and alarms.host_state() == {}
    first, tracker = _start(alarms, model)
    assert alarms.running is first
    _feed(first, [2.0, 1.8, 1.5, 1.2, 1.0, 0.9])
    saved = alarms.host_state()
    assert saved["loss_levels"]["seen"] == 6  # the running fit's state
    alarms.end()
    tracker.remove()
    assert alarms.running is None
    assert alarms.host_state()["loss_levels"] == saved["loss_levels"]  # carried

    second, tracker = _start(alarms, model)
    assert second is not first
    assert second.training_alarms.state_dict()["loss_levels"] == saved["loss_levels"]
    alarms.end()
    tracker.remove()


def test_another_models_alarm_state_is_refused_by_a_running_fit_and_dropped_by_the_next() -> None:
    """A running fit refuses a state saved for other layers (the callback then drops the whole
    checkpoint with one warning) and keeps its own; between fits such a state waits, and the
    next fit drops it with a warning and starts afresh."""
    model = _Model()
    other = AlarmsAcrossFits(AlarmRules(), check_actions("warn", "Cb"), "Cb")
    _, other_tracker = _start(other, nn.Sequential(nn.Linear(2, 2)))
    foreign = other.host_state()
    other.end()
    other_tracker.remove()

    alarms = AlarmsAcrossFits(AlarmRules(), check_actions("warn", "Cb"), "Cb")
    first, tracker = _start(alarms, model)
    _feed(first, [2.0, 1.5, 1.0])
    good = alarms.host_state()
    with pytest.raises(ValueError, match="layers"):
        alarms.load_host_state(foreign)
    assert alarms.host_state()["loss_levels"] == good["loss_levels"]
    alarms.end()
    tracker.remove()

    alarms.load_host_state(foreign)  # between fits: held until a fit starts
    with pytest.warns(LightningHooksWarning, match="running scales start afresh"):
        second, tracker = _start(alarms, model)
    assert second.training_alarms.state_dict()["loss_levels"]["seen"] == 0
    alarms.end()
    tracker.remove()


def test_each_fits_alarms_warn_of_a_rule_and_layer_once() -> None:
    """Two steps' NaN gradients in one layer, acted on twice: one warning. The next fit's alarms
    warn of them again. Fed real ``TrainingAlarms``."""
    model = _Model()
    alarms = AlarmsAcrossFits(AlarmRules(), check_actions("warn", "Cb"), "Cb")
    for fit in range(2):
        running, tracker = _start(alarms, model)
        training_alarms = running.training_alarms
        found = []
        for step in range(4):
            norm = math.nan if step in (1, 2) else 1.0
            training_alarms.update(torch.tensor([norm, 1.0, 1.0]), step=step, clip=None)
            found += training_alarms.poll(wait=True)
        assert [(a.rule, a.layer, a.step) for a in found] == [
            ("nonfinite", "net.0", 1),
            ("nonfinite", "net.0", 2),
        ]
        with pytest.warns(LightningHooksWarning) as caught:
            running.act(None, found)
            running.act(None, found)
        assert len(caught) == 1, fit
        alarms.end()
        tracker.remove()
