"""The contract every callback of the package keeps: defaults, cleanup on every exit, refit."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import pytorch_lightning as pl

from lightning_hooks import GradFlowCallback
from lightning_hooks.callbacks.activation_stats import ActivationStatsCallback
from lightning_hooks.callbacks.dead_relu import DeadReLUCallback
from lightning_hooks.callbacks.feature_map import FeatureMapCallback
from lightning_hooks.callbacks.layer_time import LayerTimeCallback
from lightning_hooks.callbacks.saturation import SaturationCallback

from conftest import TinyCNN, TinyMLP, hooks_left, read_scalars

CALLBACKS: list[Callable[[], pl.Callback]] = [GradFlowCallback]
CALLBACKS += [ActivationStatsCallback, DeadReLUCallback]
CALLBACKS += [LayerTimeCallback, FeatureMapCallback, SaturationCallback]


class HookCounter(pl.Callback):
    """Records how many forward hooks the model holds at each training batch."""

    def __init__(self) -> None:
        self.counts: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        self.counts.append(sum(len(m._forward_hooks) for m in pl_module.modules()))


@pytest.fixture(params=CALLBACKS, ids=lambda c: c.__name__)
def make_callback(request: pytest.FixtureRequest) -> Callable[[], pl.Callback]:
    return request.param  # type: ignore[no-any-return]


@pytest.mark.parametrize("model_cls", [TinyMLP, TinyCNN])
def test_trains_with_defaults_logs_and_cleans_up(
    make_callback: Callable[[], pl.Callback],
    model_cls: type[pl.LightningModule],
    trainer_factory: Any,
    tmp_path: Any,
) -> None:
    model = model_cls()
    trainer = trainer_factory(callbacks=[make_callback()])
    trainer.fit(model)
    assert read_scalars(tmp_path), "nothing was logged"
    assert hooks_left(model) == []
    assert all(not opt._optimizer_step_post_hooks for opt in trainer.optimizers)


def test_hooks_removed_after_exception_in_training_step(
    make_callback: Callable[[], pl.Callback], trainer_factory: Any
) -> None:
    model = TinyMLP(fail_at_step=2)
    trainer = trainer_factory(callbacks=[make_callback()])
    with pytest.raises(RuntimeError, match="boom in training_step"):
        trainer.fit(model)
    assert hooks_left(model) == []
    assert all(not opt._optimizer_step_post_hooks for opt in trainer.optimizers)


def test_two_fits_do_not_register_twice(
    make_callback: Callable[[], pl.Callback], trainer_factory: Any
) -> None:
    callback, model = make_callback(), TinyMLP()
    first, second = HookCounter(), HookCounter()
    trainer_factory(callbacks=[callback, first]).fit(model)
    trainer_factory(callbacks=[callback, second], max_epochs=2).fit(model)
    assert first.counts and set(first.counts) == set(second.counts)
    assert hooks_left(model) == []


def test_deepcopies_before_and_after_fit(
    make_callback: Callable[[], pl.Callback], trainer_factory: Any
) -> None:
    callback = copy.deepcopy(make_callback())
    model = TinyMLP()
    trainer_factory(callbacks=[callback]).fit(model)
    clone = copy.deepcopy(callback)
    trainer_factory(callbacks=[clone]).fit(model)
    assert hooks_left(model) == []


def test_fails_cleanly_without_a_logger(
    make_callback: Callable[[], pl.Callback], trainer_factory: Any
) -> None:
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    model = TinyMLP()
    with pytest.raises(MisconfigurationException, match=r"needs a logger.*logger=False"):
        trainer_factory(callbacks=[make_callback()], logger=False).fit(model)
    assert hooks_left(model) == []
