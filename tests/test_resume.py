"""Checkpoint resume: the reduced state travels in the checkpoint; hooks are not doubled."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from release_checkpoint import SAVED_AT, SameBatchesMLP, trainer
from torch import nn

from lightning_hooks import (
    ActivationStatsCallback,
    AlarmRules,
    DeadReLUCallback,
    GradFlowCallback,
    LayerTimeCallback,
    LightningHooksWarning,
    SaturationCallback,
)
from lightning_hooks.callbacks.base import HookCallback

from conftest import (
    TinyMLP,
    epoch_end_step,
    hooks_left,
    make_trainer,
    read_alarm_texts,
    read_scalars,
)
from support import HookCounter, RepeatedBatchMLP

RELEASE_CHECKPOINT = Path(__file__).parent / "data" / "grad_flow_0.2.0.ckpt"


def _fit(root: Path, model: TinyMLP, epochs: int, **kwargs: Any) -> HookCounter:
    counter = HookCounter()
    callbacks = [GradFlowCallback(), counter, *kwargs.pop("callbacks", [])]
    ckpt_path = kwargs.pop("ckpt_path", None)
    make_trainer(root, max_epochs=epochs, callbacks=callbacks, **kwargs).fit(
        model, ckpt_path=ckpt_path
    )
    assert hooks_left(model) == []
    return counter


def _grad_flow_at(root: Path, stepped: int) -> dict[str, float]:
    """The epoch values of the epoch that ends once ``stepped`` batches have stepped."""
    step = epoch_end_step(stepped)
    scalars = read_scalars(root)
    return {
        t: dict(v)[step]
        for t, v in scalars.items()
        if t.startswith("grad_flow/") and "_step" not in t  # the epoch's, not a logging step's
    }


def _assert_same(got: dict[str, float], want: dict[str, float], at_least: int = 30) -> None:
    assert got.keys() == want.keys() and len(want) > at_least
    for tag, value in want.items():
        assert math.isclose(got[tag], value, rel_tol=1e-6, abs_tol=1e-12), tag


def test_resume_after_epoch_one_reports_the_same_epoch_two(tmp_path: Path) -> None:
    torch.manual_seed(0)
    whole = _fit(tmp_path / "whole", TinyMLP(), epochs=2)
    torch.manual_seed(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    _fit(tmp_path / "first", TinyMLP(), 1, callbacks=[ckpt], enable_checkpointing=True)
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    state = saved[GradFlowCallback().state_key]["0:GradFlowTracker"]
    assert state["layers"] == ["net.0", "net.2", "net.4", "global"]
    assert not state["count"].any()  # saved after the epoch was logged and reset
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    resumed = _fit(
        tmp_path / "second",
        TinyMLP(),
        2,
        callbacks=[again],
        enable_checkpointing=True,
        ckpt_path=tmp_path / "ckpt" / "last.ckpt",
    )
    _assert_same(_grad_flow_at(tmp_path / "second", 8), _grad_flow_at(tmp_path / "whole", 8))
    assert set(resumed.counts) == set(whole.counts)  # as many hooks as a fresh fit: no duplicates


# Lightning's advice about non-resumable dataloaders: every batch here is the same data.
# every 3rd step: steps 0 and 2 of 4 are logging steps; the resumed run (from step 2) must not take
# its first batch for the start of an epoch.
def test_a_checkpoint_saved_between_fits_resumes_the_next_epoch_afresh(tmp_path: Path) -> None:
    """Saved by ``trainer.save_checkpoint`` after a one-epoch fit, so between fits (no statistics
    in it): the resumed fit runs epoch 1, whose alarm count (every step's gradient is over
    ``max_grad_norm``) is that epoch's alone, as in the uninterrupted fit."""

    def callbacks() -> list[pl.Callback]:
        return [GradFlowCallback(alarms=AlarmRules(max_grad_norm=1e-6), on_alarm="log")]

    torch.manual_seed(0)
    make_trainer(tmp_path / "whole", max_epochs=2, callbacks=callbacks()).fit(RepeatedBatchMLP())
    torch.manual_seed(0)
    first = make_trainer(tmp_path / "first", max_epochs=1, callbacks=callbacks())
    first.fit(RepeatedBatchMLP())
    path = tmp_path / "between.ckpt"
    first.save_checkpoint(path)
    resumed = make_trainer(tmp_path / "resumed", max_epochs=2, callbacks=callbacks())
    resumed.fit(RepeatedBatchMLP(), ckpt_path=path)
    whole = dict(read_scalars(tmp_path / "whole")["grad_flow/notices/absolute"])
    again = dict(read_scalars(tmp_path / "resumed")["grad_flow/notices/absolute"])
    assert whole == {3: 4.0, 7: 4.0}  # one a step
    assert again == {7: 4.0}


@pytest.mark.filterwarnings("ignore:.*checkpoint that ended before the epoch ended.*")
@pytest.mark.parametrize(("every", "logged_before"), [(1, 2), (3, 1)])
def test_resume_mid_epoch_carries_the_partial_epoch(
    tmp_path: Path, every: int, logged_before: int
) -> None:
    torch.manual_seed(0)
    _fit(tmp_path / "whole", RepeatedBatchMLP(), epochs=1, log_every_n_steps=every)
    torch.manual_seed(0)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    _fit(
        tmp_path / "first",
        RepeatedBatchMLP(),
        1,
        callbacks=[ckpt],
        enable_checkpointing=True,
        log_every_n_steps=every,
    )
    path = next((tmp_path / "ckpt").glob("*step=2.ckpt"))
    saved = torch.load(path, weights_only=False)["callbacks"][GradFlowCallback().state_key]
    state = saved["0:GradFlowTracker"]
    assert state["count"][:, 0].tolist() == [logged_before] * 4  # logging steps, reduced
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    _fit(
        tmp_path / "second",
        RepeatedBatchMLP(),
        1,
        callbacks=[again],
        enable_checkpointing=True,
        ckpt_path=path,
        log_every_n_steps=every,
    )
    _assert_same(_grad_flow_at(tmp_path / "second", 4), _grad_flow_at(tmp_path / "whole", 4))


def test_a_checkpoint_saved_by_release_0_2_0_resumes_with_the_same_epoch(tmp_path: Path) -> None:
    """Release 0.2.0 saved the tracker's state at the top of the callback's; it still loads."""
    whole = trainer(tmp_path / "whole", callbacks=[GradFlowCallback()])
    whole.fit(SameBatchesMLP())
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=SAVED_AT, save_top_k=-1)
    resumed = trainer(tmp_path / "resumed", callbacks=[GradFlowCallback(), every])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(SameBatchesMLP(), ckpt_path=RELEASE_CHECKPOINT)
    ours = [str(w.message) for w in caught if issubclass(w.category, LightningHooksWarning)]
    assert ours == []  # nothing dropped
    assert resumed.global_step == 4 and SAVED_AT < 4
    want = _grad_flow_at(tmp_path / "whole", 4)
    _assert_same(_grad_flow_at(tmp_path / "resumed", 4), want)
    # the epoch's count of logging steps includes the two before the checkpoint (the saved
    # weights were trained on another host: the same value to float32's last bits)
    [(step, value)] = read_scalars(tmp_path / "resumed")["grad_flow/grad_norm/net.0"]
    assert step == epoch_end_step(4)
    assert math.isclose(value, want["grad_flow/grad_norm/net.0"], rel_tol=1e-6)


def test_state_for_another_model_is_dropped_with_a_warning(tmp_path: Path) -> None:
    callback = GradFlowCallback()
    state = {"layers": ["other"], "stats": ["x"], "total": 0, "peak": 0, "count": 0}
    callback.load_state_dict(state)
    with pytest.warns(LightningHooksWarning, match="does not match this model"):
        make_trainer(tmp_path, callbacks=[callback]).fit(TinyMLP())
    assert "grad_flow/grad_norm/net.0" in read_scalars(tmp_path)


@pytest.mark.filterwarnings("ignore:.*checkpoint that ended before the epoch ended.*")
def test_a_statistic_the_checkpoint_did_not_measure_starts_afresh_and_the_rest_resume(
    tmp_path: Path,
) -> None:
    """Saved with ``stability=False``, resumed at the defaults: the tracker's epoch continues
    (the same values as an uninterrupted fit's), and the instability statistics, which the
    checkpoint holds nothing of, start afresh with one warning naming them."""
    trainer(tmp_path / "whole", callbacks=[GradFlowCallback()]).fit(SameBatchesMLP())
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=SAVED_AT, save_top_k=-1)
    first = trainer(tmp_path / "first", callbacks=[GradFlowCallback(stability=False), every])
    first.fit(SameBatchesMLP())
    path = next((tmp_path / "ckpt").glob(f"*step={SAVED_AT}.ckpt"))
    resumed = trainer(tmp_path / "resumed", callbacks=[GradFlowCallback(), every])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(SameBatchesMLP(), ckpt_path=path)
    ours = [str(w.message) for w in caught if issubclass(w.category, LightningHooksWarning)]
    assert len(ours) == 1 and "holds no state of StabilityStats" in ours[0]
    _assert_same(_grad_flow_at(tmp_path / "resumed", 4), _grad_flow_at(tmp_path / "whole", 4))


def test_a_checkpoint_with_one_statistic_of_another_model_keeps_none_of_them(
    tmp_path: Path,
) -> None:
    """The tracker's state fits, the instability statistics' does not: the checkpoint's
    statistics are dropped whole, with one warning, and the epoch is a fresh fit's."""
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=SAVED_AT, save_top_k=-1)
    trainer(tmp_path / "first", callbacks=[GradFlowCallback(), every]).fit(SameBatchesMLP())
    (path,) = sorted((tmp_path / "ckpt").glob("*.ckpt"))[:1]
    callback = GradFlowCallback()
    state = dict(torch.load(path, weights_only=False)["callbacks"][callback.state_key])
    assert state["0:GradFlowTracker"]["count"] is not None  # the tracker's epoch so far
    state["1:StabilityStats"] = {**state["1:StabilityStats"], "layers": ["elsewhere"]}
    callback.load_state_dict(state)
    with pytest.warns(LightningHooksWarning, match="does not match this model"):
        trainer(tmp_path / "dropped", callbacks=[callback]).fit(SameBatchesMLP())
    trainer(tmp_path / "fresh", callbacks=[GradFlowCallback()]).fit(SameBatchesMLP())
    _assert_same(_grad_flow_at(tmp_path / "dropped", 4), _grad_flow_at(tmp_path / "fresh", 4))


def _spoil_heatmap(state: dict[str, Any]) -> None:
    state["heatmap"] = {"epochs": [{"epoch": 0, "layers": ["net.0"]}]}  # no "columns"


def _spoil_alarms(state: dict[str, Any]) -> None:
    alarms = state["alarms"]
    state["alarms"] = {**alarms, "layers": [f"other.{i}" for i in range(len(alarms["layers"]))]}


def _alarms_of_a_later_version(state: dict[str, Any]) -> None:
    state["alarms"] = {**state["alarms"], "version": 2}


def _heatmap_of_another_type(state: dict[str, Any]) -> None:
    state["heatmap"] = [0, 1]


def _alarm_counts_of_another_type(state: dict[str, Any]) -> None:
    # The alarms' other parts load before their counts fail: each is put back.
    state["alarms"] = {**state["alarms"], "counts": [0, 1]}


@pytest.mark.parametrize(
    ("spoil", "why"),
    [
        (_spoil_heatmap, "('columns')"),
        (_spoil_alarms, "(TrainingAlarms.load_state_dict: saved layers"),
        (_alarms_of_a_later_version, "(TrainingAlarms.load_state_dict: a state of version 2;"),
        (_heatmap_of_another_type, None),  # the error is Python's own: its words are not ours
        (_alarm_counts_of_another_type, None),
    ],
    ids=["heatmap", "alarms", "alarms-version", "heatmap-type", "alarm-counts-type"],
)
def test_a_checkpoint_with_one_part_that_does_not_load_keeps_nothing_of_its_state(
    spoil: Callable[[dict[str, Any]], None], why: str | None, tmp_path: Path
) -> None:
    """The statistics load, then a later part of the state (the alarms' running scales, the
    heatmap's history) does not: nothing of the checkpoint is kept, with one warning that names
    every part dropped, and the epoch and the running scales are a fresh fit's."""
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=SAVED_AT, save_top_k=-1)
    trainer(tmp_path / "first", callbacks=[GradFlowCallback(), every]).fit(SameBatchesMLP())
    (path,) = sorted((tmp_path / "ckpt").glob("*.ckpt"))[:1]
    callback = GradFlowCallback()
    state = dict(torch.load(path, weights_only=False)["callbacks"][callback.state_key])
    assert list(callback.lifecycle.checkpoint.kept) == [
        "alarms",
        "heatmap",
    ]  # the alarms load first
    spoil(state)
    callback.load_state_dict(state)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(tmp_path / "dropped", callbacks=[callback]).fit(SameBatchesMLP())
    ours = [str(w.message) for w in caught if issubclass(w.category, LightningHooksWarning)]
    assert len(ours) == 1, ours
    assert f"does not match this model {why or '('}" in ours[0]
    assert ours[0].endswith("none of it is loaded (statistics, alarms, heatmap)")
    fresh = GradFlowCallback()
    trainer(tmp_path / "fresh", callbacks=[fresh]).fit(SameBatchesMLP())
    _assert_same(_grad_flow_at(tmp_path / "dropped", 4), _grad_flow_at(tmp_path / "fresh", 4))
    # the alarms' running scales began afresh too, not from the checkpoint's steps
    dropped_scale = callback.lifecycle.checkpoint.kept["alarms"].host_state()["scale"]
    assert torch.equal(
        dropped_scale, fresh.lifecycle.checkpoint.kept["alarms"].host_state()["scale"]
    )


class MixedMLP(RepeatedBatchMLP):
    """Tanh and ReLU layers, so that every per-step callback has something to watch."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)
        )


class _ResultProbe(pl.Callback):
    """Placed before the watched callback: its statistic's result at each epoch end."""

    def __init__(self, watched: HookCallback) -> None:
        self.watched = watched
        self.results: list[Any] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        attached = self.watched.lifecycle.attached
        assert attached is not None
        self.results.append(attached.logged[0].stat.result())


_PER_STEP = {
    "activations/": lambda: ActivationStatsCallback(heatmaps=False),
    "dead_relu/": lambda: DeadReLUCallback(types=(nn.ReLU, nn.Tanh)),
    "saturation/": lambda: SaturationCallback(margin=0.2),
    "layer_time/": lambda: LayerTimeCallback(chart=False),
}


def _fit_with(root: Path, make: Callable[[], HookCallback], **kwargs: Any) -> _ResultProbe:
    torch.manual_seed(0)
    callback = make()
    probe = _ResultProbe(callback)
    callbacks = [probe, callback, *kwargs.pop("callbacks", [])]
    ckpt_path = kwargs.pop("ckpt_path", None)
    make_trainer(root, callbacks=callbacks, **kwargs).fit(MixedMLP(), ckpt_path=ckpt_path)
    return probe


@pytest.mark.filterwarnings("ignore:.*checkpoint that ended before the epoch ended.*")
@pytest.mark.parametrize("prefix", list(_PER_STEP))
def test_every_per_step_callback_resumes_mid_epoch_with_the_same_values(
    tmp_path: Path, prefix: str
) -> None:
    make = _PER_STEP[prefix]
    whole = _fit_with(tmp_path / "whole", make)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    _fit_with(tmp_path / "first", make, callbacks=[ckpt], enable_checkpointing=True)
    path = next((tmp_path / "ckpt").glob("*step=2.ckpt"))
    saved = torch.load(path, weights_only=False)["callbacks"][make().state_key]
    statistics = {key: state for key, state in saved.items() if key not in ("heatmaps", "epoch")}
    assert statistics and all(state["layers"] for state in statistics.values())
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    resumed = _fit_with(
        tmp_path / "second", make, callbacks=[again], enable_checkpointing=True, ckpt_path=path
    )
    if prefix == "layer_time/":  # wall times differ; what was timed must not
        got, want = resumed.results[0], whole.results[0]
        assert (got.steps, got.calls.tolist()) == (want.steps, want.calls.tolist()) == (4, [4] * 5)
        return
    logged = {
        name: {
            t: v for t, v in _at(tmp_path / name, epoch_end_step(4)).items() if t.startswith(prefix)
        }
        for name in ("whole", "second")
    }
    _assert_same(logged["second"], logged["whole"], at_least=4)


def _at(root: Path, step: int) -> dict[str, float]:
    return {t: dict(v)[step] for t, v in read_scalars(root).items() if step in dict(v)}


def _last_images(root: Path, prefix: tuple[str, ...]) -> dict[str, tuple[int, bytes]]:
    """The last image of each tag under ``prefix``, with its step, from the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    images: dict[str, tuple[int, bytes]] = {}
    for events in sorted(root.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"images": 0})
        acc.Reload()
        for tag in acc.Tags()["images"]:
            if tag.startswith(prefix):
                last = acc.Images(tag)[-1]
                images[tag] = (last.step, last.encoded_image_string)
    return images


def test_a_resumed_fit_draws_the_heatmaps_of_the_epochs_before_its_checkpoint(
    tmp_path: Path,
) -> None:
    """Fit 4 epochs at once, or 2 then resume from the last checkpoint for 2 more: the last
    heatmaps (gradient norm, and the activations') are the same pictures, every epoch in them."""

    def callbacks() -> list[pl.Callback]:
        return [GradFlowCallback(heatmap=True), ActivationStatsCallback()]

    def fit(root: Path, epochs: int, *extra: pl.Callback, ckpt_path: Path | None = None) -> None:
        torch.manual_seed(0)
        trainer = make_trainer(
            root,
            max_epochs=epochs,
            callbacks=[*callbacks(), *extra],
            enable_checkpointing=bool(extra),
        )
        trainer.fit(RepeatedBatchMLP(), ckpt_path=ckpt_path)

    fit(tmp_path / "whole", 4)
    fit(tmp_path / "first", 2, ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True))
    last = tmp_path / "ckpt" / "last.ckpt"
    fit(tmp_path / "second", 4, ModelCheckpoint(dirpath=tmp_path / "ckpt"), ckpt_path=last)
    prefix = ("grad_flow/heatmap", "activations/heatmap/")
    whole = _last_images(tmp_path / "whole", prefix)
    resumed = _last_images(tmp_path / "second", prefix)
    assert len(whole) == 4  # the gradient norm's, and the activations' mean, std, zero_fraction
    assert resumed.keys() == whole.keys()
    for tag, (step, image) in whole.items():
        assert resumed[tag][0] == step, tag
        assert resumed[tag][1] == image, tag  # the same pixels: epochs 0 to 3 in both


def test_one_module_type_alone_or_in_a_tuple_resumes_the_same_checkpoint(tmp_path: Path) -> None:
    """``types=nn.Linear`` and ``types=(nn.Linear,)`` select the same layers: one checkpoint."""
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    first = GradFlowCallback(types=nn.Linear)
    trainer = make_trainer(
        tmp_path / "first", max_epochs=1, callbacks=[first, ckpt], enable_checkpointing=True
    )
    trainer.fit(TinyMLP())
    resumed = GradFlowCallback(types=(nn.Linear,))
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    assert resumed.state_key in saved
    # A state under another key would make Lightning warn that a callback is missing (an error
    # under this suite's filters); this one is the resumed callback's own.
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    make_trainer(
        tmp_path / "second", max_epochs=2, callbacks=[resumed, again], enable_checkpointing=True
    ).fit(TinyMLP(), ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert resumed.lifecycle.checkpoint.kept["alarms"].host_state()


class _FailsBeforeTraining(pl.Callback):
    """A user's callback whose ``on_fit_start`` raises: the fit ends before its train start."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        raise RuntimeError("the user's callback failed")


def test_a_checkpoint_held_by_a_fit_that_never_trained_is_not_restored_by_the_next(
    tmp_path: Path,
) -> None:
    """A fit resumed from a checkpoint fails before its train start; the next fit of the same
    callback, with no checkpoint, logs what a fresh callback logs."""

    def every() -> ModelCheckpoint:
        return ModelCheckpoint(
            dirpath=tmp_path / "ckpt", every_n_train_steps=SAVED_AT, save_top_k=-1
        )

    trainer(tmp_path / "first", callbacks=[GradFlowCallback(), every()]).fit(SameBatchesMLP())
    (path,) = sorted((tmp_path / "ckpt").glob("*.ckpt"))[:1]
    callback = GradFlowCallback()
    failing = trainer(tmp_path / "failed", callbacks=[callback, every(), _FailsBeforeTraining()])
    with pytest.raises(RuntimeError, match="the user's callback failed"):
        failing.fit(SameBatchesMLP(), ckpt_path=path)
    trainer(tmp_path / "again", callbacks=[callback]).fit(SameBatchesMLP())
    trainer(tmp_path / "fresh", callbacks=[GradFlowCallback()]).fit(SameBatchesMLP())
    _assert_same(_grad_flow_at(tmp_path / "again", 4), _grad_flow_at(tmp_path / "fresh", 4))


def test_a_fit_after_one_that_failed_counts_only_its_own_alarms(tmp_path: Path) -> None:
    """Every step's gradient is over ``max_grad_norm``. A fit that fails at its fourth batch
    counts three such notices it never wrote; the next fit of the same callback writes the four
    of its own epoch, as a fresh callback does, not seven."""
    tag = "grad_flow/notices/absolute"

    def callback() -> GradFlowCallback:
        return GradFlowCallback(alarms=AlarmRules(max_grad_norm=1e-6), on_alarm="log")

    carried = callback()
    with pytest.raises(RuntimeError, match="boom in training_step"):
        make_trainer(tmp_path / "failed", callbacks=[carried]).fit(RepeatedBatchMLP(fail_at_step=3))
    torch.manual_seed(0)
    make_trainer(tmp_path / "again", callbacks=[carried]).fit(RepeatedBatchMLP())
    torch.manual_seed(0)
    make_trainer(tmp_path / "fresh", callbacks=[callback()]).fit(RepeatedBatchMLP())
    fresh = read_scalars(tmp_path / "fresh")[tag]
    assert fresh == [(3, 4.0)]  # one notice per step of the epoch
    assert read_scalars(tmp_path / "again")[tag] == fresh


def test_a_checkpoint_at_an_epochs_last_batch_resumes_the_next_epoch_afresh(
    tmp_path: Path,
) -> None:
    """Saved at step 4, the last batch of epoch 0, before its epoch end: the fit resumes at epoch
    1, and its values, alarm counts included (every step's gradient is over
    ``max_grad_norm``), are the uninterrupted fit's epoch 1, not epochs 0 and 1 merged."""

    def callbacks(*more: pl.Callback) -> list[pl.Callback]:
        rules = AlarmRules(max_grad_norm=1e-6)
        return [GradFlowCallback(alarms=rules, on_alarm="log"), DeadReLUCallback(), *more]

    def every() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)

    torch.manual_seed(0)
    make_trainer(tmp_path / "whole", max_epochs=2, callbacks=callbacks()).fit(RepeatedBatchMLP())
    torch.manual_seed(0)
    first = make_trainer(
        tmp_path / "first", max_epochs=2, callbacks=callbacks(every()), enable_checkpointing=True
    )
    first.fit(RepeatedBatchMLP())
    path = next((tmp_path / "ckpt").glob("*step=4.ckpt"))
    resumed = make_trainer(
        tmp_path / "resumed", max_epochs=2, callbacks=callbacks(every()), enable_checkpointing=True
    )
    resumed.fit(RepeatedBatchMLP(), ckpt_path=path)
    whole = read_scalars(tmp_path / "whole")
    again = read_scalars(tmp_path / "resumed")
    epoch_tags = [
        t
        for t in whole
        if t.startswith(("grad_flow/", "dead_relu/")) and "_step" not in t and "/global/" not in t
    ]
    assert len(epoch_tags) > 20
    for tag in epoch_tags:
        assert [s for s, _ in again[tag]] == [7], tag  # epoch 0's end never ran in this fit
        assert math.isclose(again[tag][0][1], dict(whole[tag])[7], rel_tol=1e-6), tag
    assert dict(whole["grad_flow/notices/absolute"])[7] == 4.0  # one a step


@pytest.mark.filterwarnings("ignore:.*checkpoint that ended before the epoch ended.*")
def test_a_fit_resumed_mid_epoch_writes_the_alarms_read_before_its_checkpoint(
    tmp_path: Path,
) -> None:
    """Every step's gradient is over ``max_grad_norm``; logging steps 0, 2, 4 and 5, the epoch's
    step 3. A checkpoint after step 1, which no logging step wrote: the resumed fit writes it at
    its first logging step, with step 2's, as the uninterrupted fit does, and its epoch's text
    counts what its scalar counts."""

    def callback() -> GradFlowCallback:
        rules = AlarmRules(max_grad_norm=1e-6)
        return GradFlowCallback(alarms=rules, on_alarm="log", every_n_steps=3)

    def every() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)

    torch.manual_seed(0)
    make_trainer(tmp_path / "whole", max_epochs=2, callbacks=[callback()]).fit(RepeatedBatchMLP())
    torch.manual_seed(0)
    make_trainer(
        tmp_path / "first", max_epochs=2, callbacks=[callback(), every()], enable_checkpointing=True
    ).fit(RepeatedBatchMLP())
    path = next((tmp_path / "ckpt").glob("*step=2.ckpt"))
    make_trainer(
        tmp_path / "resumed",
        max_epochs=2,
        callbacks=[callback(), every()],
        enable_checkpointing=True,
    ).fit(RepeatedBatchMLP(), ckpt_path=path)
    whole = read_scalars(tmp_path / "whole")
    resumed = read_scalars(tmp_path / "resumed")
    step_tag = "grad_flow/notices_step/absolute"
    assert [s for s, _ in whole[step_tag]] == [0, 2, 3, 4, 5, 7]
    assert resumed[step_tag] == [(s, n) for s, n in whole[step_tag] if s >= 2]
    assert dict(resumed[step_tag])[2] == 2.0  # steps 1 and 2
    assert resumed["grad_flow/notices/absolute"] == whole["grad_flow/notices/absolute"]
    headers = [text.split("\n")[0] for text in read_alarm_texts(tmp_path / "resumed")]
    want = [text.split("\n")[0] for text in read_alarm_texts(tmp_path / "whole")][1:]
    assert headers == want
    assert "0 warnings and 4 notices in epoch 0" in headers


# Lightning's advice to a fit that has an OnExceptionCheckpoint and no ckpt_path.
@pytest.mark.filterwarnings("ignore:.*was called without a model.*")
@pytest.mark.filterwarnings("ignore:.*there is no last checkpoint available.*")
@pytest.mark.filterwarnings("ignore:.*checkpoint that ended before the epoch ended.*")
def test_a_fit_resumed_from_lightnings_exception_checkpoint_continues_the_failed_epoch(
    tmp_path: Path,
) -> None:
    """The fit fails at its third batch; Lightning's ``OnExceptionCheckpoint`` saves after the
    callback's ``on_exception``, which kept the epoch so far. Resumed from it, the epoch's values
    and alarm counts (one a step) are the uninterrupted fit's."""

    def callback() -> GradFlowCallback:
        return GradFlowCallback(alarms=AlarmRules(max_grad_norm=1e-6), on_alarm="log")

    torch.manual_seed(0)
    make_trainer(tmp_path / "whole", callbacks=[callback()]).fit(RepeatedBatchMLP())
    torch.manual_seed(0)
    on_exception = OnExceptionCheckpoint(tmp_path / "ckpt")
    failing = make_trainer(
        tmp_path / "failed", callbacks=[callback(), on_exception], enable_checkpointing=True
    )
    with pytest.raises(RuntimeError, match="boom in training_step"):
        failing.fit(RepeatedBatchMLP(fail_at_step=2))
    path = tmp_path / "ckpt" / "on_exception.ckpt"
    saved = torch.load(path, weights_only=False)["callbacks"][callback().state_key]
    assert "0:GradFlowTracker" in saved  # the epoch so far, kept before the hooks went
    make_trainer(tmp_path / "resumed", callbacks=[callback()]).fit(
        RepeatedBatchMLP(), ckpt_path=path
    )
    whole = read_scalars(tmp_path / "whole")
    resumed = read_scalars(tmp_path / "resumed")
    tags = [t for t in whole if t.startswith("grad_flow/") and "_step" not in t]
    assert len(tags) > 30
    for tag in tags:
        ((_, want),) = whole[tag]
        ((_, got),) = resumed[tag]  # at Lightning's epoch step of the resumed fit
        assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12), tag
    assert whole["grad_flow/notices/absolute"][0][1] == 4.0


@pytest.mark.filterwarnings("ignore:.*checkpoint that ended before the epoch ended.*")
def test_the_loss_rules_resume_under_accumulation_as_if_never_stopped(tmp_path: Path) -> None:
    """Two micro-batches a step: a fit resumed after its first optimizer step ends with the loss
    rules' state of the uninterrupted fit, to the bit: how many losses make a step is saved
    with the running levels, and the first step, highest step and trail the messages quote."""

    def fit(root: Path, *more: pl.Callback, **kwargs: Any) -> GradFlowCallback:
        callback = GradFlowCallback()
        make_trainer(
            root,
            max_epochs=3,
            accumulate_grad_batches=2,
            callbacks=[callback, *more],
            enable_checkpointing=bool(more),
        ).fit(RepeatedBatchMLP(), **kwargs)
        return callback

    def every() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)

    torch.manual_seed(0)
    whole = fit(tmp_path / "whole")
    torch.manual_seed(0)
    fit(tmp_path / "first", every())
    path = next((tmp_path / "ckpt").glob("*step=1.ckpt"))
    resumed = fit(tmp_path / "resumed", every(), ckpt_path=path)
    want = whole.lifecycle.checkpoint.kept["alarms"].host_state()
    got = resumed.lifecycle.checkpoint.kept["alarms"].host_state()
    assert want["loss_per_step"] == 2
    keys = ("loss_levels", "loss_recent", "loss_per_step", "loss_step", "loss_group")
    for key in (*keys, "loss_start", "loss_peak"):
        assert got[key] == want[key], key
    assert got["loss_trail"] == want["loss_trail"]
