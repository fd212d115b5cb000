"""The callbacks in real Fabric loops: values read back from the event files, against plain
torch; the alarms; clipping; release; refusals."""

from __future__ import annotations

import gc
import math
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger, TensorBoardLogger
from lightning.fabric.strategies import FSDPStrategy
from lightning_fabric.utilities.exceptions import MisconfigurationException
from torch import nn
from torch.optim import optimizer as torch_optimizer

from lightning_hooks import ActivationStatsCallback, GradFlowCallback
from lightning_hooks.callbacks.fabric_run import FabricTrainer, check_fabric
from lightning_hooks.errors import LightningHooksWarning, TrainingAlarmWarning

from conftest import epoch_end_step, hooks_left, read_scalars, trainer_view_members


def _fabric(root: Path, callback: Any, **kwargs: Any) -> Fabric:
    logger = TensorBoardLogger(str(root), name="tb", version=0)
    return Fabric(accelerator="cpu", devices=1, callbacks=[callback], loggers=[logger], **kwargs)


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)


def _layer_norms(model: nn.Module) -> dict[str, float]:
    """Plain torch: the L2 norm of each layer's gradient (weight and bias together)."""
    return {
        name: math.sqrt(sum(float(p.grad.pow(2).sum()) for p in m.parameters()))
        for name, m in model.named_children()
        if any(True for _ in m.parameters())
    }


def _train(
    fabric: Fabric,
    model: nn.Module,
    steps: int,
    *,
    clip: float | None = None,
    spike_at: int = -1,
    feed_loss: bool = False,
) -> dict[int, dict[str, tuple[float, float]]]:
    """A plain Fabric loop; per step and layer, ``(pre-clip, applied)`` gradient norms."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped, opt = fabric.setup(model, opt)
    seen: dict[int, dict[str, tuple[float, float]]] = {}
    for step in range(steps):
        x, y = _batch(step)
        loss = nn.functional.mse_loss(wrapped(x), y) * (1e6 if step == spike_at else 1.0)
        if feed_loss:
            fabric.call("on_before_backward", loss)
        fabric.backward(loss)
        before = _layer_norms(model)
        if clip is not None:
            fabric.clip_gradients(wrapped, opt, max_norm=clip)
        after = _layer_norms(model)
        seen[step] = {k: (before[k], after[k]) for k in before}
        opt.step()
        opt.zero_grad()
    return seen


def test_fabric_loop_logs_each_logging_step_as_plain_torch(tmp_path: Path) -> None:
    """No call of ours in the loop and none at its end: the steps 3, 7, 11 are in the event
    files, each layer's gradient norm as plain torch computes it."""
    model = _model()
    callback = GradFlowCallback(every_n_steps=4)
    fabric = _fabric(tmp_path, callback)
    seen = _train(fabric, model, 12)
    scalars = read_scalars(tmp_path / "tb")
    for layer in ("0", "2"):
        logged = scalars[f"grad_flow/grad_norm_step/{layer}"]
        assert [s for s, _ in logged] == [3, 7, 11]
        for step, value in logged:
            assert value == pytest.approx(seen[step][layer][1], rel=1e-5)
    assert "grad_flow/output_grad_norm_step/0" in scalars
    assert "grad_flow/update_ratio_step/2" in scalars
    # still watching: the loop may go on (module hooks are on the modules on logging steps only)
    assert callback._fit is not None and len(callback._fit.tracker.registry)


def test_fabric_default_cadence_is_50_and_the_spike_warns(tmp_path: Path) -> None:
    """The issue's case: 120 steps, a 1e6x gradient at step 37: warned at step 37, logging
    steps at 49 and 99 (Fabric has no log_every_n_steps: 50)."""
    fabric = _fabric(tmp_path, GradFlowCallback())
    with pytest.warns(TrainingAlarmWarning) as record:
        _train(fabric, _model(), 120, spike_at=37)
    alarms = [w.message.alarm for w in record if hasattr(w.message, "alarm")]  # type: ignore[union-attr]
    assert alarms[0].step == 37  # nothing before the spike; what it wrecked after
    assert ("explosion", 37) in {(a.rule, a.step) for a in alarms}
    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["grad_flow/global/grad_norm_step"]] == [49, 99]
    assert scalars["grad_flow/alarms_step/explosion"][0][1] >= 1


def test_fabric_clip_gradients_preclip_norm_is_exact(tmp_path: Path) -> None:
    """Under fabric.clip_gradients the pre-clip norm is read before the clip and the applied
    gradient after it: both as plain torch."""
    model = _model()
    fabric = _fabric(tmp_path, GradFlowCallback(every_n_steps=2))
    seen = _train(fabric, model, 6, clip=0.05)
    scalars = read_scalars(tmp_path / "tb")
    for step, value in scalars["grad_flow/grad_norm_preclip_step/0"]:
        assert value == pytest.approx(seen[step]["0"][0], rel=1e-5)
    for step, value in scalars["grad_flow/grad_norm_step/0"]:
        assert value == pytest.approx(seen[step]["0"][1], rel=1e-5)
        assert seen[step]["0"][1] < seen[step]["0"][0]  # the clip did clip
    assert [s for s, _ in scalars["grad_flow/grad_norm_step/0"]] == [1, 3, 5]


def test_fabric_clip_bound_that_changes_every_step_keeps_the_epochs_values(
    tmp_path: Path,
) -> None:
    """A ``max_norm`` that changes at every step (a schedule of the clip) keeps the fit: the
    epoch's gradient norms are the means over its logging steps of what plain torch reads,
    before and after the clip, not the last step's alone."""
    model = _model()
    fabric = _fabric(tmp_path, GradFlowCallback(every_n_steps=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped, opt = fabric.setup(model, opt)
    seen = {}
    for step in range(6):
        x, y = _batch(step)
        fabric.backward(nn.functional.mse_loss(wrapped(x), y))
        before = _layer_norms(model)["0"]
        fabric.clip_gradients(wrapped, opt, max_norm=0.04 + 0.002 * step)
        seen[step] = (before, _layer_norms(model)["0"])
        opt.step()
        opt.zero_grad()
    fabric.call("on_train_epoch_end")
    scalars = read_scalars(tmp_path / "tb")
    logging_steps = [1, 3, 5]
    assert [s for s, _ in scalars["grad_flow/grad_norm_step/0"]] == logging_steps
    preclip = sum(seen[s][0] for s in logging_steps) / len(logging_steps)
    applied = sum(seen[s][1] for s in logging_steps) / len(logging_steps)
    assert scalars["grad_flow/grad_norm_preclip/0"][0][1] == pytest.approx(preclip, rel=1e-5)
    assert scalars["grad_flow/grad_norm/0"][0][1] == pytest.approx(applied, rel=1e-5)
    assert len({seen[s][1] for s in logging_steps}) == len(logging_steps)  # each step differs


def test_fabric_loss_rules_read_the_fed_loss(tmp_path: Path) -> None:
    """``fabric.call("on_before_backward", loss)`` feeds the loss rules: the loss spike at step
    37 is named diverging; without the line only the gradient rules speak."""
    with pytest.warns(TrainingAlarmWarning) as record:
        _train(
            _fabric(tmp_path / "a", GradFlowCallback()), _model(), 40, spike_at=37, feed_loss=True
        )
    rules = {w.message.alarm.rule for w in record if hasattr(w.message, "alarm")}
    assert "diverging" in rules or "loss_spike" in rules
    with pytest.warns(TrainingAlarmWarning) as record:
        _train(_fabric(tmp_path / "b", GradFlowCallback()), _model(), 40, spike_at=37)
    rules = {w.message.alarm.rule for w in record if hasattr(w.message, "alarm")}
    assert not rules & {"diverging", "loss_spike"}


def test_fabric_epoch_end_and_release(tmp_path: Path) -> None:
    """``fabric.call("on_train_epoch_end")`` writes the aggregates and the chart;
    ``fabric.call("on_train_end")`` removes every hook; a released module leaves nothing."""
    model = _model()
    fabric = _fabric(tmp_path, GradFlowCallback(every_n_steps=2))
    _train(fabric, model, 4)
    fabric.call("on_train_epoch_end")
    scalars = read_scalars(tmp_path / "tb")
    assert [s for s, _ in scalars["grad_flow/grad_norm/0"]] == [epoch_end_step(4)]
    fabric.call("on_train_end")
    assert hooks_left(model) == []

    gone = _model()
    ref = weakref.ref(gone)
    gc.collect()  # the runs of the tests before
    pre_hooks = len(torch_optimizer._global_optimizer_pre_hooks)
    _train(_fabric(tmp_path / "b", GradFlowCallback(every_n_steps=2)), gone, 2)
    assert len(torch_optimizer._global_optimizer_pre_hooks) == pre_hooks + 1
    del gone
    gc.collect()
    assert ref() is None  # the Fabric, the callback and the module went together
    assert len(torch_optimizer._global_optimizer_pre_hooks) == pre_hooks


def test_fabric_csv_logger_gets_the_scalars(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    cb = GradFlowCallback(every_n_steps=2, chart=False)
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[cb], loggers=[logger])
    _train(fabric, _model(), 4)
    fabric.call("on_train_end")
    text = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    assert "grad_flow/grad_norm_step/0" in text


def test_fabric_trainer_offers_what_the_callbacks_read(tmp_path: Path) -> None:
    fabric = _fabric(tmp_path, GradFlowCallback())
    trainer = FabricTrainer(fabric, GradFlowCallback(), _model())
    assert sorted(n for n in trainer_view_members() if not hasattr(trainer, n)) == []
    assert hasattr(trainer.strategy, "precision_plugin")


def test_fabric_refusals(tmp_path: Path) -> None:
    with pytest.raises(MisconfigurationException, match=r"on_alarm=.*'stop'.*must be in \('warn'"):
        _train(_fabric(tmp_path, GradFlowCallback(on_alarm="stop")), _model(), 1)
    # without alarms, no rule can stop the fit: on_alarm="stop" is not refused
    _train(_fabric(tmp_path, GradFlowCallback(alarms=False, on_alarm="stop")), _model(), 1)
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[GradFlowCallback()])
    with pytest.raises(MisconfigurationException, match=r"needs a logger.*Fabric has none"):
        _train(fabric, _model(), 1)
    sharded = SimpleNamespace(strategy=FSDPStrategy(), loggers=[CSVLogger(str(tmp_path))])
    with pytest.raises(MisconfigurationException, match=r"supports strategy in .*got FSDPStrategy"):
        check_fabric(GradFlowCallback(), sharded)


@pytest.mark.parametrize(
    "name", ["ActivationStatsCallback", "DeadReLUCallback", "SaturationCallback"]
)
def test_other_callbacks_log_under_fabric(tmp_path: Path, name: str) -> None:
    import lightning_hooks

    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )
    fabric = _fabric(tmp_path, getattr(lightning_hooks, name)(every_n_steps=2))
    _train(fabric, model, 4)
    fabric.call("on_train_epoch_end")
    fabric.call("on_train_end")
    assert read_scalars(tmp_path / "tb")
    assert hooks_left(model) == []


@pytest.mark.parametrize(
    ("name", "why"),
    [("LayerTimeCallback", "pl_module.device"), ("FeatureMapCallback", "probe images")],
)
def test_trainer_only_callbacks_refused_under_fabric(tmp_path: Path, name: str, why: str) -> None:
    import lightning_hooks

    fabric = _fabric(tmp_path, getattr(lightning_hooks, name)())
    with pytest.raises(
        MisconfigurationException, match=rf"{name} does not work under Fabric.*{why}"
    ):
        _train(fabric, _model(), 1)


class _Observing(ActivationStatsCallback):
    """A user's subclass that reads each optimizer step, which its parent does not."""

    def __init__(self) -> None:
        super().__init__(every_n_steps=2)
        self.steps: list[int] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.steps.append(trainer.global_step)


def test_the_run_calls_on_before_optimizer_step_where_the_callback_defines_one(
    tmp_path: Path,
) -> None:
    """The run hands each optimizer step to the callback's own ``on_before_optimizer_step``;
    a callback that keeps Lightning's empty one (ActivationStatsCallback) still logs."""
    from lightning_hooks.callbacks.trainer import inherits_empty_hook

    observing = _Observing()
    _train(_fabric(tmp_path / "a", observing), _model(), 3)
    assert observing.steps == [0, 1, 2]
    activations = ActivationStatsCallback(every_n_steps=2)
    assert inherits_empty_hook(activations, "on_before_optimizer_step")
    assert not inherits_empty_hook(observing, "on_before_optimizer_step")
    model = _model()
    _train(_fabric(tmp_path / "b", activations), model, 3)
    assert read_scalars(tmp_path / "b" / "tb")
    activations.release()
    assert hooks_left(model) == []


def test_a_callback_kept_after_its_run_ended_holds_no_model(tmp_path: Path) -> None:
    """After ``fabric.call("on_train_end")`` the user may keep the callback (to read it, or for
    the next loop): it holds no Fabric, module or optimizer."""
    callback = GradFlowCallback(every_n_steps=2)
    model = _model()
    ref = weakref.ref(model)
    fabric = _fabric(tmp_path, callback)
    _train(fabric, model, 2)
    fabric.call("on_train_end")
    assert callback.fabric_run is None
    del model, fabric
    gc.collect()
    assert ref() is None


def test_releasing_one_callback_keeps_the_others_clip_observer(tmp_path: Path) -> None:
    """Two callbacks each observe ``fabric.clip_gradients``; the second is released after step 3:
    the first still reads the gradient before the clip, as plain torch."""
    model = _model()
    kept = GradFlowCallback(every_n_steps=2)
    released = ActivationStatsCallback(every_n_steps=2)
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    fabric = Fabric(accelerator="cpu", devices=1, callbacks=[kept, released], loggers=[logger])
    wrapped, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    before_clip = {}
    for step in range(8):
        x, y = _batch(step)
        fabric.backward(nn.functional.mse_loss(wrapped(x), y))
        before_clip[step] = _layer_norms(model)["0"]
        fabric.clip_gradients(wrapped, opt, max_norm=0.05)
        opt.step()
        opt.zero_grad()
        if step == 3:
            released.release()
    fabric.call("on_train_end")
    preclip = read_scalars(tmp_path / "tb")["grad_flow/grad_norm_preclip_step/0"]
    assert [s for s, _ in preclip] == [1, 3, 5, 7]
    for step, value in preclip:
        assert value == pytest.approx(before_clip[step], rel=1e-5), step
    assert not any("clip_gradients" in name for name in vars(fabric.strategy))


def test_fabric_setup_module_is_said_once_with_the_fix(tmp_path: Path) -> None:
    """``fabric.setup_module`` calls no callback, so nothing can be watched: the first optimizer
    step says so once, naming ``fabric.setup``, and the loop trains on with no hook of ours."""
    model = _model()
    fabric = _fabric(tmp_path, GradFlowCallback(every_n_steps=2))
    wrapped = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05))
    with pytest.warns(LightningHooksWarning, match=r"fabric\.setup\(model, optimizer\)") as said:
        for step in range(4):
            x, y = _batch(step)
            fabric.backward(nn.functional.mse_loss(wrapped(x), y))
            opt.step()
            opt.zero_grad()
    assert len([w for w in said if "watches nothing" in str(w.message)]) == 1
    assert hooks_left(model) == []


def _epoch_is_the_mean_of_its_steps(root: Path, layers: tuple[str, ...]) -> None:
    """Each layer's epoch ``grad_norm`` is the mean of the values its logging steps wrote."""
    scalars = read_scalars(root / "tb")
    for layer in layers:
        steps = [value for _, value in scalars[f"grad_flow/grad_norm_step/{layer}"]]
        assert len(steps) == 6, layer
        [(_, epoch)] = scalars[f"grad_flow/grad_norm/{layer}"]
        assert epoch == pytest.approx(sum(steps) / len(steps), rel=1e-5), layer


# The first attach knows the first optimizer only (Fabric names an optimizer when it steps).
@pytest.mark.filterwarnings("ignore:.*no optimizer of the Trainer steps.*")
def test_fabric_a_second_optimizer_keeps_the_epoch_so_far(tmp_path: Path) -> None:
    """Two optimizers, one per Linear: the second's first step attaches the fit again, and the
    epoch so far is carried over, so each layer's epoch mean is that of all its logged steps."""
    model = _model()
    fabric = _fabric(tmp_path, GradFlowCallback(every_n_steps=1, chart=False))
    first = torch.optim.SGD(model[0].parameters(), lr=0.05)
    second = torch.optim.SGD(model[2].parameters(), lr=0.05)
    wrapped, first, second = fabric.setup(model, first, second)
    for step in range(6):
        x, y = _batch(step)
        fabric.backward(nn.functional.mse_loss(wrapped(x), y))
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
    fabric.call("on_train_epoch_end")
    fabric.call("on_train_end")
    _epoch_is_the_mean_of_its_steps(tmp_path, ("0", "2"))


def test_fabric_clipping_that_begins_mid_epoch_keeps_the_epoch_so_far(tmp_path: Path) -> None:
    """``fabric.clip_gradients`` from step 3 on attaches the fit again (to measure after the
    clip); the epoch so far is carried over."""
    model = _model()
    fabric = _fabric(tmp_path, GradFlowCallback(every_n_steps=1, chart=False))
    wrapped, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for step in range(6):
        x, y = _batch(step)
        fabric.backward(nn.functional.mse_loss(wrapped(x), y))
        if step >= 3:
            fabric.clip_gradients(wrapped, opt, max_norm=10.0)  # above every norm: no change
        opt.step()
        opt.zero_grad()
    fabric.call("on_train_epoch_end")
    fabric.call("on_train_end")
    _epoch_is_the_mean_of_its_steps(tmp_path, ("0", "2"))


def test_fabric_lbfgs_reads_the_gradient_of_the_steps_own_closure(tmp_path: Path) -> None:
    """LBFGS evaluates its closure inside the step: each logging step's gradient norm is the one
    of that step's first evaluation, as plain torch computes it (and as the Trainer logs), not
    the previous step's last; the output gradients of that evaluation are logged too."""
    model = _model()
    fabric = _fabric(tmp_path, GradFlowCallback(every_n_steps=2))
    wrapped, opt = fabric.setup(model, torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3))
    first: dict[int, dict[str, float]] = {}
    for step in range(6):
        x, y = _batch(step)

        def closure(step: int = step, x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = nn.functional.mse_loss(wrapped(x), y)
            fabric.backward(loss)
            first.setdefault(step, _layer_norms(model))
            return loss

        opt.step(closure)
    fabric.call("on_train_end")
    scalars = read_scalars(tmp_path / "tb")
    for layer in ("0", "2"):
        logged = scalars[f"grad_flow/grad_norm_step/{layer}"]
        assert [s for s, _ in logged] == [1, 3, 5]
        for step, value in logged:
            assert value == pytest.approx(first[step][layer], rel=1e-5), (layer, step)
    assert [s for s, _ in scalars["grad_flow/output_grad_norm_step/0"]] == [1, 3, 5]
    assert hooks_left(model) == []
