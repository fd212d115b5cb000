"""GradFlowCallback through a real ``Trainer.fit``, read back from TensorBoard event files."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pytorch_lightning.loggers import CSVLogger

from lightning_hooks import AlarmRules, GradFlowCallback, LightningHooksWarning
from lightning_hooks.errors import TrainingAlarmWarning

from conftest import (
    MetricsOnlyLogger,
    TinyMLP,
    epoch_end_step,
    hooks_left,
    make_trainer,
    read_image_tags,
    read_scalars,
)
from support import LAYERS, ReferenceMLP
from syncs import SyncWindow, count_syncs


def _expected(
    steps: list[dict[str, dict[str, float]]], layer: str, stat: str
) -> tuple[float, float]:
    values = np.array([s[layer][stat] for s in steps])
    return float(values.mean()), float(values.max())


@pytest.mark.parametrize("accumulate", [1, 2])
def test_logged_values_equal_an_independent_computation(
    accumulate: int, trainer_factory: Any, tmp_path: Path
) -> None:
    model = ReferenceMLP()
    trainer = trainer_factory(
        callbacks=[GradFlowCallback()], max_epochs=2, accumulate_grad_batches=accumulate
    )
    trainer.fit(model)
    scalars = read_scalars(tmp_path)
    steps_per_epoch = 4 // accumulate
    assert len(model.steps) == 2 * steps_per_epoch
    for epoch in range(2):
        steps = model.steps[epoch * steps_per_epoch : (epoch + 1) * steps_per_epoch]
        at = epoch_end_step((epoch + 1) * steps_per_epoch)  # the epoch's last step
        for layer in LAYERS:
            for stat, mean_tag, max_tag in (
                ("grad_norm", "grad_norm", "grad_norm_max"),
                ("grad_abs_mean", "grad_abs_mean", None),
                ("grad_abs_max", None, "grad_abs_max"),
                ("weight_norm", "weight_norm", None),
                ("update_ratio", "update_ratio", "update_ratio_max"),
                ("output_grad_norm", "output_grad_norm", "output_grad_norm_max"),
            ):
                mean, peak = _expected(steps, layer, stat)
                for tag, want in ((mean_tag, mean), (max_tag, peak)):
                    if tag is None:
                        continue
                    logged = dict(scalars[f"grad_flow/{tag}/{layer}"])[at]
                    assert math.isclose(logged, want, rel_tol=1e-5), (tag, layer, epoch)
            assert dict(scalars[f"grad_flow/grad_nonfinite/{layer}"])[at] == 0
        global_norms = [math.sqrt(sum(s[n]["grad_norm"] ** 2 for n in LAYERS)) for s in steps]
        logged = dict(scalars["grad_flow/global/grad_norm"])[at]
        assert math.isclose(logged, float(np.mean(global_norms)), rel_tol=1e-5)
    assert read_image_tags(tmp_path) == ["grad_flow/chart"]


def test_a_logging_step_logs_each_layer_statistic_but_the_epoch_peaks(
    trainer_factory: Any, tmp_path: Path
) -> None:
    """A logging step logs each per-layer statistic of the epoch under its ``_step`` tag, but
    the epoch's peaks: a step's value is the statistic itself (``GradFlowCallback``'s table)."""
    trainer_factory(callbacks=[GradFlowCallback()], max_epochs=1).fit(ReferenceMLP())
    layer = LAYERS[0]
    stats = [tag.split("/")[1] for tag in read_scalars(tmp_path) if tag.endswith(f"/{layer}")]
    per_step = {stat.removesuffix("_step") for stat in stats if stat.endswith("_step")}
    per_epoch = {stat for stat in stats if not stat.endswith("_step")}
    peaks = {"grad_norm_max", "update_ratio_max", "output_grad_norm_max"}
    assert peaks < per_epoch
    assert per_step == per_epoch - peaks


class WideReferenceMLP(ReferenceMLP):
    """ReferenceMLP with layers past the |g| pass's small-tensor and one-piece sizes: net.0's
    32x1024 weight goes through the reused buffer, net.2's 1100x1024 in two pieces. A small
    learning rate: wide layers at lr 0.1 diverge (and the alarms rightly say so)."""

    def __init__(self) -> None:
        super().__init__(lr=1e-3)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32 * 1024 // 8),
            torch.nn.ReLU(),
            torch.nn.Linear(32 * 1024 // 8, 1100),
            torch.nn.ReLU(),
            torch.nn.Linear(1100, 1),
        )


def test_large_layers_logged_values_equal_an_independent_computation_at_defaults(
    trainer_factory: Any, tmp_path: Path
) -> None:
    from lightning_hooks.core.ops.grouped_norms import CHUNK

    torch.manual_seed(0)
    model = WideReferenceMLP()
    assert model.net[2].weight.numel() > CHUNK  # the chunked path runs
    trainer = trainer_factory(callbacks=[GradFlowCallback()], max_epochs=1)
    trainer.fit(model)
    scalars = read_scalars(tmp_path)
    at = epoch_end_step(len(model.steps))
    for layer in LAYERS:
        for stat, tag in (("grad_abs_mean", "grad_abs_mean"), ("grad_abs_max", "grad_abs_max")):
            mean, peak = _expected(model.steps, layer, stat)
            want = peak if tag.endswith("max") else mean
            logged = dict(scalars[f"grad_flow/{tag}/{layer}"])[at]
            assert math.isclose(logged, want, rel_tol=1e-5), (tag, layer)


def test_no_host_sync_between_logging_steps(
    trainer_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = SyncWindow()
    with count_syncs(monkeypatch) as counter:
        probe.counter = counter
        trainer_factory(callbacks=[probe, GradFlowCallback()], max_epochs=2).fit(TinyMLP())
    assert probe.windows == 2
    assert dict(counter.calls) == {}


def test_sync_counter_catches_a_sync_in_a_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(2, 1)
    with count_syncs(monkeypatch, root=__file__) as counter:
        counter.active = True
        out = model(torch.ones(1, 2))
        out.register_hook(lambda g: g * float(g.sum().item() != 0))
        out.sum().backward()
    assert counter.calls["item"] == 1


def test_inplace_relu_model_trains_and_reports_finite_values(
    trainer_factory: Any, tmp_path: Path
) -> None:
    model = TinyMLP(inplace=True)
    trainer_factory(callbacks=[GradFlowCallback()]).fit(model)
    scalars = read_scalars(tmp_path)
    for layer in LAYERS:
        ((_, value),) = scalars[f"grad_flow/output_grad_norm/{layer}"]
        assert math.isfinite(value) and value > 0
    assert hooks_left(model) == []


def test_csv_logger_gets_scalars_and_the_chart(trainer_factory: Any, tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    trainer_factory(callbacks=[GradFlowCallback()], logger=logger).fit(TinyMLP())
    run = tmp_path / "csv" / "version_0"
    header = (run / "metrics.csv").read_text().splitlines()[0]
    assert "grad_flow/grad_norm/net.0" in header.split(",")
    chart = f"step_{epoch_end_step(4):06d}.png"  # one epoch of 4 steps
    assert [p.name for p in (run / "grad_flow" / "chart").iterdir()] == [chart]


def test_scalars_only_logger_gets_scalars_and_one_warning(
    trainer_factory: Any, tmp_path: Path
) -> None:
    logger = MetricsOnlyLogger()
    with pytest.warns(LightningHooksWarning, match="images need TensorBoard") as record:
        trainer_factory(callbacks=[GradFlowCallback()], logger=logger).fit(TinyMLP())
    assert len([w for w in record if w.category is LightningHooksWarning]) == 1
    assert any("grad_flow/grad_norm/net.0" in metrics for metrics, _ in logger.logged)


def test_chart_off_needs_no_tensorboard(trainer_factory: Any, tmp_path: Path) -> None:
    """With the chart off, a CSV logger gets the scalars and no warning of missing images."""
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_factory(callbacks=[GradFlowCallback(chart=False)], logger=logger).fit(TinyMLP())
    assert not [w for w in caught if issubclass(w.category, LightningHooksWarning)]
    header = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert "grad_flow/grad_norm/net.0" in header.split(",")


def test_pattern_matching_nothing_fails_at_setup(trainer_factory: Any) -> None:
    model = TinyMLP()
    named = r"GradFlowCallback\(include='net\.9'\) matches no module.*'net\.0'"
    with pytest.raises(ValueError, match=named):
        trainer_factory(callbacks=[GradFlowCallback(include="net.9")]).fit(model)
    assert hooks_left(model) == []


def test_include_and_types_select_layers(trainer_factory: Any, tmp_path: Path) -> None:
    callback = GradFlowCallback(types=torch.nn.Linear, exclude="net.4")
    trainer_factory(callbacks=[callback]).fit(TinyMLP())
    layers = {t.rsplit("/", 1)[1] for t in read_scalars(tmp_path) if "/grad_norm/" in t}
    assert layers == {"net.0", "net.2"}


def test_bad_types_argument_is_named() -> None:
    with pytest.raises(
        TypeError, match=r"GradFlowCallback\(types=3\): must be a subclass of one of \['Module'\]"
    ):
        GradFlowCallback(types=3)  # type: ignore[arg-type]


class _FirstLayerInEvalMode(TinyMLP):
    """Its first Linear in eval mode every epoch (a frozen backbone's set-up), still trained: a
    Linear computes the same in either mode, so the fit is the train-mode one, step for step."""

    def on_train_epoch_start(self) -> None:
        self.net[0].eval()


def test_a_submodule_in_eval_mode_gets_its_output_gradient_measured(tmp_path: Path) -> None:
    runs = {}
    for name, model in (("eval", _FirstLayerInEvalMode), ("train", TinyMLP)):
        torch.manual_seed(0)
        make_trainer(tmp_path / name, callbacks=[GradFlowCallback()]).fit(model())
        runs[name] = read_scalars(tmp_path / name)
    assert "grad_flow/output_grad_norm/net.0" in runs["eval"]
    assert runs["eval"] == runs["train"]  # every tag and value, net.0's output gradient among them


class MyGradFlow(GradFlowCallback):
    """A user's subclass, which adds nothing."""


def test_a_subclass_names_itself_in_its_errors_and_its_alarms(tmp_path: Path) -> None:
    """A subclass's constructor errors and its alarms begin with its own name, as its lifecycle's
    messages do."""
    with pytest.raises(ValueError, match=r"^MyGradFlow\(on_alarm='wran'\)"):
        MyGradFlow(on_alarm="wran")
    with pytest.raises(TypeError, match=r"^MyGradFlow\(alarms=3\)"):
        MyGradFlow(alarms=3)  # type: ignore[arg-type]
    rules = AlarmRules(max_grad_norm=1e-12, diverge_ratio=None)
    callback = MyGradFlow(alarms=rules, chart=False)
    with pytest.warns(TrainingAlarmWarning, match=r"^MyGradFlow \[absolute\]: "):
        make_trainer(tmp_path, max_epochs=1, callbacks=[callback]).fit(TinyMLP())
