"""Lightning dispatches only the per-batch hooks our callbacks define (``callbacks/trainer.py``),
through a real ``Trainer.fit``; the shadows go with the fit, and nothing our callbacks log
changes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
from pytorch_lightning.profilers import PassThroughProfiler

import lightning_hooks
from lightning_hooks.callbacks.trainer import PER_BATCH_HOOKS

from conftest import BoundedMLP, TinyMLP, default_callback_types, make_trainer, read_scalars


class _Actions(PassThroughProfiler):
    """Lightning's profiler, counting the callback hooks it was asked to time."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def start(self, action_name: str) -> None:
        if action_name.startswith("[Callback]"):
            self.calls[action_name.split("]", 1)[1]] += 1


def _hooks_called(calls: Counter[str], callback: pl.Callback) -> set[str]:
    prefix = f"{callback.state_key}."
    return {name.removeprefix(prefix) for name in calls if name.startswith(prefix)}


@pytest.mark.parametrize("cls", default_callback_types(), ids=lambda c: c.__name__)
def test_only_the_per_batch_hooks_a_callback_defines_are_dispatched(
    cls: type[pl.Callback], tmp_path: Path
) -> None:
    profiler = _Actions()
    callback = cls()
    trainer = make_trainer(tmp_path, profiler=profiler, callbacks=[callback], limit_train_batches=3)
    trainer.fit(BoundedMLP())
    defined = {n for n in PER_BATCH_HOOKS if getattr(cls, n) is not getattr(pl.Callback, n)}
    called = _hooks_called(profiler.calls, callback) & set(PER_BATCH_HOOKS)
    assert "on_train_batch_start" in defined  # every one of ours keeps its cadence
    assert called == {n for n in defined if n.startswith(("on_train", "on_before", "on_after"))}
    assert not set(PER_BATCH_HOOKS) & set(vars(callback))  # the shadows went with the fit
    assert "on_fit_start" in _hooks_called(profiler.calls, callback)  # the others as before


class _Counted(lightning_hooks.GradFlowCallback):
    """A user's subclass defining a hook ours inherit: it is called, with ours."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.backward_calls = 0

    def on_before_backward(self, *args: Any) -> None:
        self.backward_calls += 1


def test_a_subclass_hook_and_a_second_fit_run_as_before(tmp_path: Path) -> None:
    callback = _Counted()
    seen = []
    for run in ("a", "b"):  # the same instance fits twice
        make_trainer(tmp_path / run, limit_train_batches=4, callbacks=[callback]).fit(TinyMLP())
        assert not set(PER_BATCH_HOOKS) & set(vars(callback))
        seen.append(read_scalars(tmp_path / run / "tb" / "version_0"))
    assert callback.backward_calls == 8
    tags = [t for t in seen[0] if t.startswith("grad_flow/") and t.endswith("_step")]
    assert tags
    assert all(len(seen[1][t]) == len(seen[0][t]) == 4 for t in tags)  # every step, both fits


def test_an_instance_attribute_someone_set_is_left_alone(tmp_path: Path) -> None:
    callback = lightning_hooks.GradFlowCallback()
    calls: list[int] = []
    callback.on_after_backward = lambda *args: calls.append(1)  # type: ignore[method-assign]
    make_trainer(tmp_path, limit_train_batches=3, callbacks=[callback]).fit(TinyMLP())
    assert calls == [1, 1, 1]
    assert callable(callback.on_after_backward)
