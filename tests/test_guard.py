"""The guard: an exception in one of our hooks disables that callback for the rest of the fit with
one warning, training goes on, every hook is still removed; strict mode re-raises."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl

from lightning_hooks import (
    ActivationStatsCallback,
    DeadReLUCallback,
    FeatureMapCallback,
    GradFlowCallback,
    LightningHooksWarning,
)
from lightning_hooks.core.hooks import guard as guard_module
from lightning_hooks.core.hooks.guard import STRICT_ENV, Guard
from lightning_hooks.core.stats import activation_stats as activation_stats_module
from lightning_hooks.core.stats import output_grad as output_grad_module
from lightning_hooks.core.stats.activation_stats import ActivationStatsTracker
from lightning_hooks.core.stats.grad_flow import GradFlowTracker

from conftest import TinyMLP, epoch_end_step, hooks_left, make_trainer, read_scalars


class BoomError(RuntimeError):
    pass


def _fail_after(calls: int, original: Callable[..., Any]) -> Callable[..., Any]:
    """``original``, raising :class:`BoomError` from its ``calls``-th call on."""
    seen = [0]

    def patched(*args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        if seen[0] > calls:
            raise BoomError(f"injected failure after {calls} calls")
        return original(*args, **kwargs)

    return patched


class HookCounter(pl.Callback):
    def __init__(self) -> None:
        self.forward_hooks: list[int] = []
        self.optimizer_hooks: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.forward_hooks.append(sum(len(m._forward_hooks) for m in pl_module.modules()))
        opt = trainer.optimizers[0]
        self.optimizer_hooks.append(len(opt._optimizer_step_post_hooks))


# (what fails, where the message says it failed, the callback that owns it)
CASES = {
    "forward hook": (ActivationStatsTracker, "observe", "forward hook on 'net.", "Activation"),
    # the small outputs' statistics, measured in a batch at the end of the logging step
    "batched statistics": (
        activation_stats_module,
        "stacked_feature_stats",
        "on_train_batch_end hook",
        "Activation",
    ),
    "output gradient hook": (
        output_grad_module,
        "_output_norm",
        "output gradient hook",
        "Grad",
    ),
    "optimizer hook": (GradFlowTracker, "_after_step", "optimizer step post-hook", "Grad"),
    "lightning hook": (GradFlowTracker, "observe", "on_before_optimizer_step hook", "Grad"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_failing_hook_disables_its_callback_and_training_goes_on(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STRICT_ENV, "0")
    owner, attr, where, failing = CASES[case]
    monkeypatch.setattr(owner, attr, _fail_after(3, getattr(owner, attr)))
    model, counter = TinyMLP(), HookCounter()
    callbacks = [
        GradFlowCallback(every_n_steps=1),
        ActivationStatsCallback(every_n_steps=1),
        DeadReLUCallback(every_n_steps=1),
        counter,
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, callbacks=callbacks, max_epochs=2).fit(model)
    ours = [w for w in caught if issubclass(w.category, LightningHooksWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    message = str(ours[0].message)
    assert message.startswith(f"{failing}")
    assert "disabled for the rest of the fit" in message
    assert where in message and "BoomError: injected failure after 3 calls" in message
    assert model.trainer.global_step == 8  # training went on: 2 epochs x 4 batches
    scalars = read_scalars(tmp_path)
    # The healthy callback logged both epochs; the failed one nothing after its failure.
    epochs = [epoch_end_step(4), epoch_end_step(8)]
    assert [s for s, _ in scalars["dead_relu/dead_fraction/net.1"]] == epochs
    prefix = "grad_flow/" if failing == "Grad" else "activations/"
    assert all(s <= epochs[0] for tag, v in scalars.items() if tag.startswith(prefix) for s, _ in v)
    # Its hooks went at the first Lightning hook after the failure, the others' stayed.
    assert counter.forward_hooks[0] > counter.forward_hooks[-1] > 0
    assert hooks_left(model) == []
    assert not model.trainer.optimizers[0]._optimizer_step_post_hooks


def test_strict_reraises_the_original_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert guard_module.strict_default()  # the suite runs strict (tests/conftest.py)
    norm = output_grad_module._output_norm
    monkeypatch.setattr(output_grad_module, "_output_norm", _fail_after(3, norm))
    model = TinyMLP()
    trainer = make_trainer(tmp_path, callbacks=[GradFlowCallback(every_n_steps=1)])
    with pytest.raises(BoomError, match="injected failure after 3 calls"):
        trainer.fit(model)
    assert hooks_left(model) == []


def test_strict_false_on_the_callback_wins_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(GradFlowTracker, "observe", _fail_after(0, GradFlowTracker.observe))
    callback = GradFlowCallback(every_n_steps=1)
    callback.strict = False
    model = TinyMLP()
    with pytest.warns(LightningHooksWarning, match="GradFlowCallback is disabled.*BoomError"):
        make_trainer(tmp_path, callbacks=[callback]).fit(model)
    assert model.trainer.global_step == 4
    assert not any(tag.startswith("grad_flow/") for tag in read_scalars(tmp_path))
    # A second fit starts healthy (and strict again, from the environment).
    callback.strict = None
    monkeypatch.undo()
    make_trainer(tmp_path / "second", callbacks=[callback]).fit(model)
    assert "grad_flow/global/grad_norm" in read_scalars(tmp_path / "second")


def test_library_errors_are_never_swallowed() -> None:
    from lightning_hooks import TrainingAlarmError

    guard = Guard("GradFlowCallback", strict=False)
    error = TrainingAlarmError("spike", rule="spike", layer="global", step=3, value=9.0)

    def raise_alarm() -> None:
        raise error

    with pytest.raises(TrainingAlarmError, match="spike"):
        guard.wrap(raise_alarm, "on_before_optimizer_step hook")()
    assert guard.failed is None


def test_a_failing_probe_disables_feature_maps_for_the_fit(tmp_path: Path) -> None:
    def broken(module: Any, probe: Any) -> None:
        raise BoomError("probe forward failed")

    model = TinyMLP()
    callbacks = [FeatureMapCallback(forward_fn=broken, strict=False), GradFlowCallback()]
    with pytest.warns(LightningHooksWarning, match=r"FeatureMapCallback is disabled.*"):
        make_trainer(tmp_path, callbacks=callbacks, max_epochs=2).fit(model)
    scalars = read_scalars(tmp_path)
    assert model.trainer.global_step == 8
    assert not [t for t in scalars if t.startswith("feature_map/")]
    assert [s for s, _ in scalars["grad_flow/global/grad_norm"]] == [
        epoch_end_step(4),
        epoch_end_step(8),
    ]
    assert hooks_left(model) == []
