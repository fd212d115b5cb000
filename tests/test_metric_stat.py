"""``MetricStat``: a torchmetrics ``Metric`` per layer through ``Trainer.fit``, read back from the
event files and compared with the same metric updated by hand on the outputs a hook of the
test's own recorded; its states across a mid-epoch resume; what it refuses."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from ddp_metric_run import Recorder
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torchmetrics import CatMetric, MaxMetric, MeanMetric, Metric

from lightning_hooks import LightningHooksWarning, MetricStat, StatsCallback

from conftest import TinyMLP, epoch_end_step, make_trainer, read_scalars
from support import RepeatedBatchMLP

LINEARS = ("net.0", "net.2", "net.4")


class PeakAbs(Metric):
    """A user's own metric: the largest ``|x|`` seen (a ``max`` state) over how many updates (an
    integer ``sum`` state)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("peak", default=torch.tensor(0.0), dist_reduce_fx="max")
        self.add_state("calls", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, x: torch.Tensor) -> None:
        self.peak = torch.maximum(self.peak, x.abs().max())
        self.calls += 1

    def compute(self) -> torch.Tensor:
        return self.peak / self.calls


def _by_hand(metric: Metric, outputs: list[torch.Tensor]) -> float:
    fresh = metric.clone()
    fresh.reset()
    for output in outputs:
        fresh.update(output)
    return float(fresh.compute())


def _epoch_values(root: Path, prefix: str) -> dict[str, dict[int, float]]:
    return {t: dict(v) for t, v in read_scalars(root).items() if t.startswith(prefix)}


def test_each_layers_metric_equals_the_same_metric_updated_by_hand(tmp_path: Path) -> None:
    model = TinyMLP()
    recorder = Recorder(model)
    mean = MetricStat(MeanMetric(), name="output_mean", types=nn.Linear)
    peak = MetricStat(PeakAbs(), include="net.4")
    make_trainer(tmp_path, max_epochs=2, callbacks=[StatsCallback([mean, peak])]).fit(model)
    logged = _epoch_values(tmp_path, "metrics/")
    assert set(logged) == {f"metrics/output_mean/{n}" for n in LINEARS} | {"metrics/peak_abs/net.4"}
    epochs = [epoch_end_step(4), epoch_end_step(8)]  # 4 batches an epoch, each a logging step
    for epoch, step in enumerate(epochs):
        for name, outputs in recorder.outputs.items():
            seen = outputs[4 * epoch : 4 * epoch + 4]
            got = logged[f"metrics/output_mean/{name}"]
            assert list(got) == epochs
            want = _by_hand(MeanMetric(), seen)
            assert math.isclose(got[step], want, rel_tol=1e-6), (name, epoch)
            plain = float(torch.cat([o.flatten() for o in seen]).double().mean())
            assert math.isclose(got[step], plain, rel_tol=1e-5, abs_tol=1e-7)
        seen = recorder.outputs["net.4"][4 * epoch : 4 * epoch + 4]
        want = max(float(o.abs().max()) for o in seen) / 4
        assert math.isclose(logged["metrics/peak_abs/net.4"][step], want, rel_tol=1e-6)


def test_only_the_logging_steps_outputs_are_fed(tmp_path: Path) -> None:
    """``every_n_steps=2`` measures steps 0, 1 and 3 of an epoch of 4 (each epoch's first, then
    ``n-1, 2n-1``): the metric sees those steps' outputs only."""
    model = TinyMLP()
    recorder = Recorder(model)
    stat = MetricStat(MaxMetric(), include="net.2")
    callback = StatsCallback(stat, every_n_steps=2)
    make_trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(model)
    outputs = recorder.outputs["net.2"]
    want = max(float(outputs[i].max()) for i in (0, 1, 3))
    epoch = (epoch_end_step(4), pytest.approx(want, rel=1e-6))
    assert read_scalars(tmp_path)["metrics/max/net.2"] == [epoch]


@pytest.mark.filterwarnings("ignore:.*checkpoint that ended before the epoch ended.*")
def test_a_mid_epoch_resume_logs_what_the_uninterrupted_fit_logs(tmp_path: Path) -> None:
    def fit(root: Path, *callbacks: Any, ckpt_path: Path | None = None) -> None:
        torch.manual_seed(0)
        stats = [MetricStat(MeanMetric(), types=nn.Linear), MetricStat(PeakAbs(), types=nn.ReLU)]
        trainer = make_trainer(
            root,
            max_epochs=2,
            callbacks=[StatsCallback(stats), *callbacks],
            enable_checkpointing=bool(callbacks),
        )
        trainer.fit(RepeatedBatchMLP(), ckpt_path=ckpt_path)

    fit(tmp_path / "whole")
    fit(
        tmp_path / "first", ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    )
    path = next((tmp_path / "ckpt").glob("*step=6.ckpt"))
    saved = torch.load(path, weights_only=False)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("StatsCallback")]
    assert state["0:MetricStat"]["layers"] == list(LINEARS)
    assert state["0:MetricStat"]["updates"].tolist() == [2.0, 2.0, 2.0]  # steps 4 and 5
    assert set(state["0:MetricStat"]["metric_states"]) == {"mean_value", "weight"}
    assert state["1:MetricStat"]["metric_states"]["calls"].tolist() == [[2, 2]]  # one rank
    again = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    fit(tmp_path / "second", again, ckpt_path=path)
    whole = _epoch_values(tmp_path / "whole", "metrics/")
    second = _epoch_values(tmp_path / "second", "metrics/")
    assert len(whole) == 5 and set(second) == set(whole)  # 3 Linear and 2 ReLU layers
    last = epoch_end_step(8)
    for tag, values in whole.items():
        assert list(second[tag]) == [last], tag  # the resumed fit logs its epoch 1 only
        assert math.isclose(second[tag][last], values[last], rel_tol=1e-6), tag


def test_refused_at_construction_with_the_argument_named() -> None:
    with pytest.raises(TypeError, match=r"MetricStat\(metric=.*add the parentheses"):
        MetricStat(MeanMetric)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must be a torchmetrics\.Metric instance"):
        MetricStat(torch.mean)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"list states \(value\) are not supported"):
        MetricStat(CatMetric())
    with pytest.raises(ValueError, match=r"MetricStat\(name='a/b'\): must be a non-empty str"):
        MetricStat(MeanMetric(), name="a/b")
    with pytest.raises(TypeError, match=r"MetricStat\(metircs=\.\.\.\): unknown argument"):
        MetricStat(MeanMetric(), metircs=1)  # type: ignore[call-arg]


class Growing(Metric):
    """Keeps a state whose shape changes with its input: refused (it cannot be stacked)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("seen", default=torch.zeros(0), dist_reduce_fx="sum")

    def update(self, x: torch.Tensor) -> None:
        self.seen = x.sum(0)

    def compute(self) -> torch.Tensor:
        return self.seen.sum()


def test_a_state_whose_shape_update_changes_is_refused_in_the_hook() -> None:
    model = nn.Sequential(nn.Linear(2, 3))
    refused = pytest.raises(ValueError, match=r"changed the shape of state 'seen' from \(0,\)")
    with MetricStat(Growing()).attach(model.train()), refused:
        model(torch.ones(4, 2))


def test_a_compute_that_is_not_one_number_is_named() -> None:
    class PerUnit(MeanMetric):
        def compute(self) -> torch.Tensor:
            return torch.ones(3)

    model = nn.Sequential(nn.Linear(2, 3))
    with MetricStat(PerUnit()).attach(model.train()) as stat:
        model(torch.ones(4, 2))
        with pytest.raises(TypeError, match=r"PerUnit\.compute\(\) returned \(3,\); one number"):
            stat.result()


def test_a_failing_compute_in_a_fit_disables_the_callback_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_HOOKS_STRICT", "0")  # the suite's guards raise; a user's warn

    class PerUnit(MeanMetric):
        def compute(self) -> torch.Tensor:
            return torch.ones(3)

    callback = StatsCallback(MetricStat(PerUnit(), include="net.0"))
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[callback])
    with pytest.warns(LightningHooksWarning, match=r"PerUnit\.compute\(\) returned \(3,\)") as got:
        trainer.fit(TinyMLP())
    assert len([w for w in got if issubclass(w.category, LightningHooksWarning)]) == 1
    assert trainer.global_step == 8  # the fit went on
    assert not [t for t in read_scalars(tmp_path) if t.startswith("metrics/")]


def test_a_state_saved_by_another_number_of_processes_is_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 3))
    with MetricStat(MeanMetric()).attach(model.train()) as stat:
        model(torch.ones(4, 2))
        state = stat.host_state()
    state["metric_states"] = {k: v.repeat(2, 1) for k, v in state["metric_states"].items()}
    with MetricStat(MeanMetric()).attach(model) as fresh:
        with pytest.raises(ValueError, match="saved by 2 processes, resumed on 1"):
            fresh.load_host_state(state)
        assert fresh.layers == ()  # nothing of it was restored


def test_a_nan_output_a_metric_refuses_warns_once_and_the_fit_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIGHTNING_HOOKS_STRICT", "0")  # the suite's guards raise; a user's warn

    class NanAtStep2(TinyMLP):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.trainer.global_step == 2:
                x = x * float("nan")
            return self.net(x)

    stats = [MetricStat(MeanMetric(nan_strategy="error"), include="net.0")]
    trainer = make_trainer(tmp_path, max_epochs=1, callbacks=[StatsCallback(stats)])
    with pytest.warns(LightningHooksWarning, match=r"StatsCallback is disabled.*nan") as got:
        trainer.fit(NanAtStep2())
    assert len([w for w in got if issubclass(w.category, LightningHooksWarning)]) == 1
    assert trainer.global_step == 4


def test_nan_strategy_disable_feeds_the_nan_through(tmp_path: Path) -> None:
    class NanAtStep2(TinyMLP):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.trainer.global_step == 2:
                x = x * float("nan")
            return self.net(x)

    stat = MetricStat(MeanMetric(nan_strategy="disable"), include="net.0")
    make_trainer(tmp_path, max_epochs=1, callbacks=[StatsCallback(stat)]).fit(NanAtStep2())
    ((_, value),) = read_scalars(tmp_path)["metrics/mean/net.0"]
    assert math.isnan(value)
