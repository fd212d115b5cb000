"""Gradient alarms through a real ``Trainer.fit``: injected faults, a normal run, the actions."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from lightning_hooks import (
    AlarmRules,
    GradFlowCallback,
    GradientAlarmError,
    GradientAlarmWarning,
    LightningHooksWarning,
)

from conftest import TinyMLP, dataset, hooks_left, read_scalars

LAYERS = ("net.0", "net.2", "net.4")
RULES = ("spike", "absolute", "vanishing", "nonfinite", "amp_overflow")
K = 30  # the step faults are injected at: well past AlarmRules.min_history
ALARM = re.compile(r"at optimizer step (\d+): (\S+)")


class LongMLP(TinyMLP):
    """TinyMLP with ``batches`` batches of 8 per epoch and a sane learning rate."""

    def __init__(self, batches: int = 40, lr: float = 0.05) -> None:
        super().__init__(lr=lr)
        self.batches = batches

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(n=8 * self.batches), batch_size=8)


class Fault(pl.Callback):
    """Injects one fault into ``layer`` at optimizer step ``step`` (``global_step``)."""

    def __init__(self, kind: str, layer: str = "net.2", step: int = K) -> None:
        self.kind, self.layer, self.step = kind, layer, step

    def _params(self, pl_module: pl.LightningModule) -> list[torch.nn.Parameter]:
        return list(pl_module.get_submodule(self.layer).parameters())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if self.kind == "nan_weight" and trainer.global_step == self.step:
            with torch.no_grad():
                self._params(pl_module)[0][0, 0] = math.nan

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        hit = trainer.global_step == self.step
        for p in self._params(pl_module):
            assert p.grad is not None
            if self.kind == "multiply" and hit:
                p.grad.mul_(1e6)
            if self.kind == "shrink" and trainer.global_step >= self.step:
                p.grad.mul_(1e-6)


class NormProbe(pl.Callback):
    """Records, in plain torch, each step's per-layer gradient norms and the weights around it."""

    def __init__(self) -> None:
        self.norms: list[list[float]] = []
        self.before: dict[int, list[torch.Tensor]] = {}
        self.after: dict[int, list[torch.Tensor]] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.before[trainer.global_step] = _snapshot(pl_module, trainer)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        self.norms.append([_layer_norm(pl_module, name) for name in LAYERS])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.after[trainer.global_step - 1] = _snapshot(pl_module, trainer)


def _layer_norm(pl_module: pl.LightningModule, name: str) -> float:
    grads = [p.grad.flatten() for p in pl_module.get_submodule(name).parameters()]  # type: ignore[union-attr]
    return float(torch.cat(grads).norm())


def _snapshot(pl_module: pl.LightningModule, trainer: pl.Trainer) -> list[torch.Tensor]:
    state = trainer.optimizers[0].state
    momenta = [state[p]["momentum_buffer"] for p in pl_module.parameters() if p in state]
    return [t.detach().clone() for t in [*pl_module.parameters(), *momenta]]


def _fit(
    trainer_factory: Any, model: pl.LightningModule, *callbacks: pl.Callback, **kw: Any
) -> Any:
    kw.setdefault("max_epochs", 1)
    trainer = trainer_factory(callbacks=list(callbacks), **kw)
    trainer.fit(model)
    return trainer


def _alarms(record: Iterator[warnings.WarningMessage]) -> list[tuple[int, str, str]]:
    """``(step, layer, message)`` of each GradientAlarmWarning, in the order emitted."""
    out = []
    for w in record:
        if issubclass(w.category, GradientAlarmWarning):
            step, layer = ALARM.search(str(w.message)).groups()  # type: ignore[union-attr]
            out.append((int(step), layer, str(w.message)))
    return out


def _texts(logdir: Path) -> dict[int, str]:
    """The ``grad_flow/alarms`` text summaries in the event files: ``step -> text``."""
    out = {}
    for path in {p.parent for p in logdir.rglob("events.out.tfevents.*")}:
        acc = EventAccumulator(str(path), size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags()["tensors"]:
            if tag.startswith("grad_flow/alarms"):
                for event in acc.Tensors(tag):
                    out[event.step] = event.tensor_proto.string_val[0].decode()
    return out


def _counts(logdir: Path, step: int) -> dict[str, float]:
    scalars = read_scalars(logdir)
    return {rule: dict(scalars[f"grad_flow/alarms/{rule}"])[step] for rule in RULES}


# every_n_steps=7 with alarms on every step: the fault's step is not sampled, so the alarms
# run on the norm-only path.
@pytest.mark.parametrize("every", [1, 7])
def test_spike_names_the_layer_at_the_step_and_none_before(
    trainer_factory: Any, tmp_path: Path, every: int
) -> None:
    assert K % 7 != 0
    probe = NormProbe()
    with pytest.warns(GradientAlarmWarning) as record:
        _fit(
            trainer_factory,
            LongMLP(),
            probe,
            Fault("multiply"),
            GradFlowCallback(every_n_steps=every, alarms=AlarmRules(every_n_steps=1)),
            max_steps=K + 2,
        )
    alarms = _alarms(record)
    assert min(step for step, _, _ in alarms) == K
    step, layer, message = next(a for a in alarms if "spike" in a[2] and a[1] != "global")
    assert (step, layer) == (K, "net.2")
    norms = np.array(probe.norms)[:, LAYERS.index("net.2")]
    window = np.sort(norms[max(0, K - 50) : K])
    median = float(window[(len(window) - 1) // 2])  # the lower median
    value, ref = (
        float(x) for x in re.findall(r"grad norm (\S+) is \S+ its running median (\S+)", message)[0]
    )
    assert math.isclose(value, norms[K], rel_tol=1e-3)
    assert math.isclose(ref, median, rel_tol=1e-3)
    counts = _counts(tmp_path, K + 2)
    assert counts["spike"] >= 2  # net.2 and the global norm at step K
    assert "net.2" in _texts(tmp_path)[K + 2]


@pytest.mark.parametrize("every", [1, 7])
def test_nan_weight_is_reported_at_that_layer(
    trainer_factory: Any, tmp_path: Path, every: int
) -> None:
    callback = GradFlowCallback(every_n_steps=every, alarms=AlarmRules(every_n_steps=1))
    with pytest.warns(GradientAlarmWarning) as record:
        _fit(trainer_factory, LongMLP(), Fault("nan_weight"), callback, max_steps=K + 2)
    alarms = _alarms(record)
    assert alarms[0][:2] == (K, "net.2")
    assert "non-finite weights" in alarms[0][2]
    assert _counts(tmp_path, K + 2)["nonfinite"] >= 3  # every layer's gradient is NaN at K


def test_vanishing_layer_is_named_after_vanish_steps(trainer_factory: Any) -> None:
    rules = AlarmRules(vanish_steps=5)
    with pytest.warns(GradientAlarmWarning) as record:
        _fit(
            trainer_factory,
            LongMLP(),
            Fault("shrink", "net.0", step=3),
            GradFlowCallback(alarms=rules),
            max_steps=12,
        )
    assert [a[:2] for a in _alarms(record)] == [(3 + 5 - 1, "net.0")]


def test_normal_run_of_200_steps_raises_no_alarm(trainer_factory: Any, tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer = _fit(trainer_factory, LongMLP(batches=200), GradFlowCallback(chart=False))
    assert trainer.global_step == 200
    assert _alarms(record) == []
    assert _counts(tmp_path, 200) == dict.fromkeys(RULES, 0.0)
    assert _texts(tmp_path)[200].startswith("0 gradient alarms in epoch 0")


def test_stop_ends_training_after_the_alarm_step(trainer_factory: Any) -> None:
    with pytest.warns(GradientAlarmWarning, match=rf"spike at optimizer step {K}: net\.2"):
        trainer = _fit(
            trainer_factory,
            LongMLP(),
            Fault("multiply"),
            GradFlowCallback(on_alarm="stop"),
            max_steps=K + 5,
        )
    assert trainer.should_stop
    assert trainer.global_step == K + 1  # step K ran (CPU: read at once); K + 1 did not


def test_raise_raises_the_library_error_and_removes_hooks(trainer_factory: Any) -> None:
    model = LongMLP()
    trainer = trainer_factory(
        callbacks=[Fault("multiply"), GradFlowCallback(on_alarm={"spike": "raise"})],
        max_steps=K + 5,
    )
    with pytest.raises(GradientAlarmError, match=rf"spike at optimizer step {K}: net\.2") as info:
        trainer.fit(model)
    assert (info.value.rule, info.value.layer, info.value.step) == ("spike", "net.2", K)
    assert info.value.value > 1e3
    assert hooks_left(model) == []
    assert all(not opt._optimizer_step_post_hooks for opt in trainer.optimizers)


def test_skip_leaves_weights_and_momentum_unchanged_for_that_step(trainer_factory: Any) -> None:
    probe = NormProbe()
    with pytest.warns(GradientAlarmWarning, match=rf"spike at optimizer step {K}: net\.2"):
        trainer = _fit(
            trainer_factory,
            LongMLP(),
            probe,
            Fault("multiply"),
            GradFlowCallback(on_alarm="skip"),
            max_steps=K + 2,
        )
    assert trainer.global_step == K + 2
    for step in (K - 1, K, K + 1):
        same = all(
            torch.equal(a, b) for a, b in zip(probe.before[step], probe.after[step], strict=True)
        )
        assert same == (step == K), step


class ScalerProbe(pl.Callback):
    """Records the GradScaler's own verdict (found inf: step skipped) at every optimizer step."""

    def __init__(self) -> None:
        self.skipped: list[bool] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        scaler = trainer.strategy.precision_plugin.scaler  # type: ignore[attr-defined]
        found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        self.skipped.append(bool(sum(v.item() for v in found.values())))


def test_amp_overflow_is_counted_never_an_explosion(trainer_factory: Any, tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    probe = ScalerProbe()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _fit(
            trainer_factory,
            LongMLP(),
            probe,
            GradFlowCallback(chart=False),
            plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        )
    assert _alarms(record) == []
    skipped = sum(probe.skipped)
    assert 0 < skipped < len(probe.skipped)
    counts = _counts(tmp_path, 40)
    assert counts == {**dict.fromkeys(RULES, 0.0), "amp_overflow": float(skipped)}
    assert "AMP overflow at optimizer step 0, step skipped" in _texts(tmp_path)[40]


def test_alarm_state_survives_a_checkpoint_resume(trainer_factory: Any, tmp_path: Path) -> None:
    model, probe = LongMLP(batches=20), NormProbe()
    first = _fit(trainer_factory, model, probe, GradFlowCallback(chart=False))
    first.save_checkpoint(tmp_path / "mid.ckpt")
    callback = GradFlowCallback(chart=False)
    trainer = trainer_factory(callbacks=[probe, callback], max_epochs=2)
    trainer.fit(model, ckpt_path=tmp_path / "mid.ckpt")
    state = callback.state_dict()["alarms"]
    assert state["seen"].tolist() == [40] * 4
    norms = np.array(probe.norms)  # 40 steps: both runs, recorded independently
    history = state["history"].numpy()[:40, :3]
    np.testing.assert_allclose(history, norms, rtol=1e-5)


def test_no_host_sync_while_alarms_fire(
    trainer_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:

    from syncs import SyncWindow, count_syncs

    window = SyncWindow()
    with count_syncs(monkeypatch) as counter, pytest.warns(GradientAlarmWarning, match="spike"):
        window.counter = counter
        _fit(
            trainer_factory,
            LongMLP(),
            window,
            Fault("multiply"),
            GradFlowCallback(chart=False),
            max_steps=K + 2,
        )
    assert window.windows == 1
    assert dict(counter.calls) == {}


def test_alarm_state_of_another_model_is_dropped_with_a_warning(trainer_factory: Any) -> None:
    from conftest import TinyCNN

    callback = GradFlowCallback(chart=False)
    _fit(trainer_factory, TinyMLP(), callback)
    with pytest.warns(LightningHooksWarning, match=r"saved layers .*differ.*start afresh"):
        _fit(trainer_factory, TinyCNN(), callback)
    assert callback.state_dict()["alarms"]["layers"][0] == "features.0"


def test_stop_is_agreed_across_ranks(trainer_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another rank's alarm stops this one: the decision goes through reduce_boolean_decision."""
    trainer = trainer_factory(callbacks=[GradFlowCallback(on_alarm="stop")], max_steps=K)
    calls: list[tuple[int, bool]] = []

    def other_rank_alarms_at_step_5(decision: bool, all: bool = True) -> bool:
        calls.append((trainer.global_step, decision))
        return decision or (not all and trainer.global_step == 5)

    monkeypatch.setattr(trainer.strategy, "reduce_boolean_decision", other_rank_alarms_at_step_5)
    trainer.fit(LongMLP())
    assert trainer.global_step == 6
    # once per optimizer step, and once more at the epoch end (the last drain); no local alarm
    assert calls == [(step, False) for step in range(7)]
