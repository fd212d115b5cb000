"""Statistics at the Trainer's logging cadence: ``..._step`` tags at every logging step of a
long epoch, equal to plain torch over exactly the steps they claim, and epoch aggregates apart."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import ActivationStatsCallback, DeadReLUCallback, GradFlowCallback
from lightning_hooks.report import read_run
from lightning_hooks.tags import ALARM_STEP_TEXT, ALARM_TEXT

from conftest import TinyMLP, dataset, epoch_end_step, make_trainer, read_scalars

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from long_epoch import Regressor, Stream

LAYERS = ("net.0", "net.2", "net.4")
_LAUNCHER_ENV = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Recorder(pl.Callback):
    """Plain torch on the steps the library measures: ``(s + 1) % n == 0`` or an epoch's first.

    Per measured optimizer step: each layer's gradient norm as the optimizer applies it, and the
    sum and element count of each layer's training outputs (every micro-batch of the step).
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.grad_norm: dict[int, dict[str, float]] = defaultdict(dict)
        self.out_sum: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.out_n: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.zero: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        self._step: int | None = None
        self._first = -1
        self._handles: list[Any] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name in LAYERS:
            module = pl_module.get_submodule(name)
            self._handles.append(module.register_forward_hook(self._hook(name)))
        relu = pl_module.get_submodule("net.1")
        self._handles.append(relu.register_forward_hook(self._zero_hook("net.1")))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            if self._step is not None and module.training:
                self.out_sum[self._step][name] += float(out.detach().double().sum())
                self.out_n[self._step][name] += out.numel()

        return hook

    def _zero_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            if self._step is not None and module.training:
                self.zero[self._step][name].append(float((out == 0).double().mean()))

        return hook

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if batch_idx == 0:
            self._first = step  # every micro-batch of an epoch's first step is measured
        measured = (step + 1) % self.every == 0 or step == self._first
        self._step = step if measured else None

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if self._step is None:
            return
        for name in LAYERS:
            grads = [p.grad.flatten() for p in pl_module.get_submodule(name).parameters()]
            self.grad_norm[self._step][name] = float(torch.linalg.vector_norm(torch.cat(grads)))

    def activation_mean(self, step: int, name: str) -> float:
        return self.out_sum[step][name] / self.out_n[step][name]


def _series(scalars: dict[str, list[tuple[int, float]]], tag: str) -> dict[int, float]:
    return dict(scalars[tag])


def _check_steps(scalars: dict[str, Any], recorder: Recorder, steps: list[int]) -> None:
    """Every ``_step`` value equals the recorder's at exactly the logging steps."""
    assert sorted(recorder.grad_norm) == steps
    for name in LAYERS:
        grad = _series(scalars, f"grad_flow/grad_norm_step/{name}")
        mean = _series(scalars, f"activations/mean_step/{name}")
        assert sorted(grad) == steps and sorted(mean) == steps
        for step in steps:
            assert grad[step] == pytest.approx(recorder.grad_norm[step][name], rel=1e-5)
            assert mean[step] == pytest.approx(recorder.activation_mean(step, name), abs=1e-6)


def test_a_long_iterable_epoch_logs_every_statistic_at_each_logging_step(tmp_path: Path) -> None:
    """The user's run: one epoch of an IterableDataset, max_steps=300, everything at defaults."""
    recorder = Recorder(every=50)
    callbacks = [GradFlowCallback(), ActivationStatsCallback(), DeadReLUCallback(), recorder]
    trainer = make_trainer(tmp_path, max_steps=300, log_every_n_steps=50, callbacks=callbacks)
    trainer.fit(Regressor(), DataLoader(Stream(), batch_size=None))
    scalars = read_scalars(tmp_path)
    loss_steps = [step for step, _ in scalars["loss"]]
    assert loss_steps == [49, 99, 149, 199, 249, 299]
    steps = [0, *loss_steps]
    _check_steps(scalars, recorder, steps)
    step_tags = [t for t in scalars if "_step/" in t or t.endswith("_step")]
    assert step_tags
    for tag in step_tags:  # every per-step statistic at each logging step, before the end
        assert [s for s, _ in scalars[tag]] == steps, tag
    zero = _series(scalars, "dead_relu/zero_fraction_step/net.1")
    for step in steps:
        assert zero[step] == pytest.approx(np.mean(recorder.zero[step]["net.1"]), abs=1e-6)
    # The epoch aggregates, apart, at the end: the mean over the same logging steps.
    for name in LAYERS:
        epoch = scalars[f"grad_flow/grad_norm/{name}"]
        assert [s for s, _ in epoch] == [epoch_end_step(300)]
        expected = np.mean([recorder.grad_norm[s][name] for s in steps])
        assert epoch[0][1] == pytest.approx(expected, rel=1e-5)
    assert [s for s, _ in scalars["dead_relu/dead_fraction/net.1"]] == [epoch_end_step(300)]
    assert not any(t.startswith("dead_relu/dead_fraction_step") for t in scalars)


@pytest.mark.parametrize(
    ("options", "steps"),
    [
        ({"accumulate_grad_batches": 2, "log_every_n_steps": 3}, [0, 2, 5, 8, 11]),
        ({"max_steps": 7, "log_every_n_steps": 3}, [0, 2, 5]),
        ({"val_check_interval": 5, "log_every_n_steps": 4}, [0, 3, 7, 11]),
    ],
    ids=["accumulation", "max_steps_mid_epoch", "val_check_interval"],
)
def test_step_values_are_exactly_the_logging_steps(
    tmp_path: Path, options: dict[str, Any], steps: list[int]
) -> None:
    recorder = Recorder(every=options["log_every_n_steps"])
    model = _Model(batches=12 * options.get("accumulate_grad_batches", 1))
    callbacks = [GradFlowCallback(), ActivationStatsCallback(), recorder]
    trainer = make_trainer(tmp_path, callbacks=callbacks, limit_val_batches=2, **options)
    trainer.fit(model)
    _check_steps(read_scalars(tmp_path), recorder, steps)


@pytest.mark.parametrize("copy", ["done at once", "done a batch later"])
def test_quiet_batches_read_no_window_and_a_late_copy_is_written_at_the_next_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copy: str
) -> None:
    """A window is read only where a logging step posted one (a quiet batch's hooks look at no
    statistic's host copy); a copy not done when the logging step looks (CUDA's non-blocking
    copy) is written at the next batch's start, with the values of its own step."""
    from lightning_hooks.callbacks.attached import Attached
    from lightning_hooks.core.stats.stat import LayerStat

    late = copy == "done a batch later"
    collect, seen = LayerStat._collect, set()

    def slow_collect(self: LayerStat[Any], wait: bool) -> None:
        box = self._host_copy
        if late and not wait and box is not None and box.pending and id(box) not in seen:
            seen.add(id(box))  # its first look without waiting: still copying
            return
        if box is not None and not box.pending:
            seen.discard(id(box))
        collect(self, wait)

    batch, reads = [-1], defaultdict(int)
    write_steps = Attached.write_steps

    def counted(self: Attached, trainer: Any, wait: bool) -> None:
        reads[batch[0]] += 1
        write_steps(self, trainer, wait)

    monkeypatch.setattr(Attached, "write_steps", counted)
    monkeypatch.setattr(LayerStat, "_collect", slow_collect)

    class Batch(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            batch[0] = args[-1]

    recorder = Recorder(every=4)
    callbacks = [Batch(), GradFlowCallback(), ActivationStatsCallback(), recorder]
    trainer = make_trainer(tmp_path, callbacks=callbacks, log_every_n_steps=4)
    trainer.fit(_Model(batches=12))
    _check_steps(read_scalars(tmp_path), recorder, [0, 3, 7, 11])
    logging = {0, 3, 7, 11}
    read = {b for b in reads if b >= 0}
    assert logging <= read <= logging | ({1, 4, 8} if late else set()), reads
    if late:  # the late copies were read, and written, at the next batch's start
        assert read == logging | {1, 4, 8}


class _Model(TinyMLP):
    """TinyMLP on ``batches`` batches of 8 (``repeated``: all the same, so a batch replayed
    after a mid-epoch resume is the same data), with a validation loop."""

    def __init__(self, batches: int, repeated: bool = False) -> None:
        super().__init__()
        self.batches, self.repeated = batches, repeated

    def train_dataloader(self) -> DataLoader[Any]:
        data = dataset(8 if self.repeated else 8 * self.batches)
        if self.repeated:
            x, y = data.tensors
            data = TensorDataset(x.repeat(self.batches, 1), y.repeat(self.batches, 1))
        return DataLoader(data, batch_size=8)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(16, seed=1), batch_size=8)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))


@pytest.mark.filterwarnings("ignore:.*checkpoint that ended before the epoch ended.*")
def test_a_resumed_epoch_logs_what_the_uninterrupted_one_logs(tmp_path: Path) -> None:
    """Checkpoint at step 5 of a 12-step epoch, resume: the same step and epoch values."""

    def run(root: Path, ckpt_path: str | None = None, **options: Any) -> dict[str, Any]:
        torch.manual_seed(0)
        callbacks: list[pl.Callback] = [GradFlowCallback(), ActivationStatsCallback()]
        callbacks += options.pop("extra", [])
        trainer = make_trainer(root, callbacks=callbacks, log_every_n_steps=3, **options)
        trainer.fit(_Model(batches=12, repeated=True), ckpt_path=ckpt_path)
        return read_scalars(root)

    whole = run(tmp_path / "whole")
    saver = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    run(tmp_path / "first", max_steps=5, enable_checkpointing=True, extra=[saver])
    ckpt = next((tmp_path / "ckpt").glob("*step=5.ckpt"))
    again = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    resumed = run(
        tmp_path / "second", ckpt_path=str(ckpt), enable_checkpointing=True, extra=[again]
    )
    for tag in ("grad_flow/grad_norm_step/net.0", "activations/mean_step/net.2"):
        after = [(s, v) for s, v in whole[tag] if s >= 5]
        assert [s for s, _ in resumed[tag]] == [s for s, _ in after]
        assert [v for _, v in resumed[tag]] == pytest.approx([v for _, v in after], rel=1e-6)
    for tag in ("grad_flow/grad_norm/net.0", "activations/mean/net.2"):
        assert resumed[tag][-1][1] == pytest.approx(whole[tag][-1][1], rel=1e-6)


def test_a_run_killed_mid_epoch_keeps_every_statistic_up_to_its_last_logging_step(
    tmp_path: Path,
) -> None:
    """SIGKILL once the user's loss is in the event file at 3 steps: ours is there at each."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, str(root / "tests" / "killed_run.py"), "--out", str(tmp_path)],
        cwd=root,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while len(read_scalars(tmp_path).get("loss", [])) < 3:
            assert proc.poll() is None, "the run ended before it was killed"
            assert time.monotonic() < deadline, "no loss in the event file after 120 s"
            time.sleep(0.2)
        assert proc.poll() is None
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    scalars = read_scalars(tmp_path)
    last = max(step for step, _ in scalars["loss"])
    logging_steps = [0, *range(9, last + 1, 10)]
    truth = {}
    for line in (tmp_path / "truth.jsonl").read_text().splitlines():
        record = json.loads(line)
        truth[record["step"]] = record["grad_norm"]
    for name in LAYERS:
        ours = dict(scalars[f"grad_flow/grad_norm_step/{name}"])
        for step in logging_steps:
            assert ours[step] == pytest.approx(truth[step][name], rel=1e-5), (name, step)
    step_tags = [t for t in scalars if "_step/" in t]
    assert any(t.startswith("activations/") for t in step_tags)
    assert any(t.startswith("dead_relu/") for t in step_tags)
    for tag in step_tags:
        assert {s for s, _ in scalars[tag]} >= set(logging_steps), tag
    assert "grad_flow/grad_norm/net.0" not in scalars  # the epoch never ended
    # The report reads the killed run at its last logging step, from its _step tags.
    report = read_run(tmp_path / "tb" / "version_0", tmp_path)
    assert report is not None
    last_written = max(s for s, _ in scalars["grad_flow/grad_norm_step/net.0"])
    assert report.step == last_written >= logging_steps[-1]
    row = next(r for r in report.layers if r.layer == "net.0")
    assert row.get("grad_norm") == dict(scalars["grad_flow/grad_norm_step/net.0"])[last_written]


def test_a_window_read_by_a_checkpoint_is_still_written_and_counted_once() -> None:
    """A checkpoint between a logging step's post and its read (CUDA: the copy in flight) folds
    the window into the epoch and keeps it for the write."""
    from lightning_hooks.core.stats.accumulator import LayerStatsAccumulator

    acc = LayerStatsAccumulator(["a"], ["x"])
    acc.update(torch.tensor([[2.0]]))
    acc.start_copy(step=3)
    acc.update(torch.tensor([[4.0]]))
    saved = acc.host_state()
    assert saved["total"].tolist() == [[6.0]] and saved["count"].tolist() == [[2.0]]
    got = acc.take_copy(wait=False)
    assert got is not None and got[0] == 3 and got[1].total.tolist() == [[2.0]]
    assert acc.take_copy(wait=False) is None
    epoch = acc.result()
    assert epoch.total.tolist() == [[6.0]] and epoch.count.tolist() == [[2.0]]


def test_alarms_reach_the_text_tab_at_the_next_logging_step(tmp_path: Path) -> None:
    """``max_grad_norm`` below every norm: an ``absolute`` alarm on every step, counted and
    listed at each logging step (every 4th), not only at the epoch end."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_hooks import AlarmRules

    rules = AlarmRules(max_grad_norm=1e-9)
    callback = GradFlowCallback(alarms=rules, chart=False)
    trainer = make_trainer(tmp_path, callbacks=[callback], log_every_n_steps=4)
    with pytest.warns(Warning):  # the alarm's warning, once per layer
        trainer.fit(_Model(batches=12))
    scalars = read_scalars(tmp_path)
    counts = dict(scalars["grad_flow/alarms_step/absolute"])
    assert sorted(counts) == [0, 3, 7, 11]
    assert all(n > 0 for n in counts.values())  # the steps polled since the last logging step
    end = epoch_end_step(12)  # the epoch's last step, also its last logging step
    epoch = dict(scalars["grad_flow/alarms/absolute"])[end]
    assert sum(counts.values()) <= epoch
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = {
        tag: {e.step: e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)}
        for tag in (f"{ALARM_STEP_TEXT}/text_summary", f"{ALARM_TEXT}/text_summary")
    }
    steps, epochs = texts.values()
    assert sorted(steps) == [0, 3, 7, 11] and sorted(epochs) == [end]
    assert re.match(r"\d+ warnings and 0 notices up to step 7", steps[7]), steps[7]
    assert "absolute" in steps[7] and "in epoch 0" in epochs[end]
    assert re.match(r"\d+ warnings and 0 notices up to step 11", steps[end]), steps[end]
