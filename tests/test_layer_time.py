"""LayerTimer and LayerTimeCallback: per-layer forward time on logging steps."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import LayerTimeCallback
from lightning_hooks.core.stats.layer_time import LayerTimer, _Clock

from conftest import epoch_end_step, hooks_left, read_image_tags, read_scalars

HEAVY = "net.3"
HEAVY_SLEEP_S = 0.02


class _SlowLinear(nn.Linear):
    """A ``Linear`` whose forward also waits ``HEAVY_SLEEP_S`` of wall-clock time.

    Its matmul alone was not enough: on a loaded CI machine one descheduling of a few
    milliseconds inside a small layer outweighed it. The wait makes the heavy layer slowest by
    a margin no scheduler noise reaches, so the test checks attribution, not the machine.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(HEAVY_SLEEP_S)
        return super().forward(x)


class HeavyNet(pl.LightningModule):
    """Small layers around one deliberately heavy, slowed ``Linear(1024, 2048)``; 6 batches."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 32),
            nn.ReLU(),
            nn.Linear(32, 1024),
            _SlowLinear(1024, 2048),
            nn.Tanh(),
            nn.Linear(2048, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(384, 8, generator=g), torch.randn(384, 1)), 64)


def test_heavy_layer_is_the_slowest_and_layer_times_fit_in_the_step(
    trainer_factory: Any, tmp_path: Path
) -> None:
    model = HeavyNet()
    trainer_factory(callbacks=[LayerTimeCallback(every_n_steps=1)]).fit(model)
    scalars = read_scalars(tmp_path)
    layers = [f"net.{i}" for i in range(6)]
    forward = {name: scalars[f"layer_time/forward_ms/{name}"][0][1] for name in layers}
    share = {name: scalars[f"layer_time/share/{name}"][0][1] for name in layers}
    ((_, step_ms),) = scalars["layer_time/step_ms"]
    assert all(value > 0 for value in forward.values())
    assert sum(forward.values()) <= step_ms
    assert max(forward, key=forward.__getitem__) == HEAVY
    assert forward[HEAVY] >= HEAVY_SLEEP_S * 1e3
    for name in layers:
        assert share[name] == pytest.approx(forward[name] / step_ms, rel=1e-5)
    assert scalars["layer_time/forward_share"][0][1] == pytest.approx(sum(share.values()), 1e-5)
    assert "layer_time/chart" in read_image_tags(tmp_path)
    assert hooks_left(model) == []


def test_only_logging_step_training_forwards_are_timed() -> None:
    model = HeavyNet()
    timer = LayerTimer(model)
    x = torch.randn(4, 8)
    for step in range(5):
        if step % 2 == 0:
            timer.start_step()
        model(x).sum().backward()
        timer.end_step()
    with torch.no_grad():
        timer.start_step()
        model(x)  # a validation-like forward: not counted
        timer.end_step()
    times = timer.result()
    assert times.layers == tuple(f"net.{i}" for i in range(6))
    assert times.steps == 4 and times.calls.tolist() == [3] * 6
    timer.reset()
    assert timer.result().steps == 0
    timer.remove()
    assert hooks_left(model) == []


def test_quiet_steps_read_no_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    marks = []
    original = _Clock.mark
    monkeypatch.setattr(_Clock, "mark", lambda self: marks.append(1) or original(self))
    model = HeavyNet()
    timer = LayerTimer(model)
    for _ in range(3):
        model(torch.randn(2, 8))
    assert marks == []
    timer.start_step()
    model(torch.randn(2, 8))
    timer.end_step()
    assert len(marks) == 2 * 6 + 2
    timer.remove()


def test_parent_modules_are_skipped_by_default_and_timed_on_request() -> None:
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 1))
    assert LayerTimer(model).layers == ("0.0", "0.1", "1")
    assert LayerTimer(model, leaves=False, include="0").layers == ("0",)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True])
def test_every_n_steps_is_validated(bad: Any) -> None:
    with pytest.raises(ValueError, match=rf"every_n_steps={bad!r}\): must be a positive int"):
        LayerTimeCallback(every_n_steps=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_events_time_the_heavy_layer() -> None:
    model = HeavyNet().net.cuda()
    timer = LayerTimer(model)
    assert timer._clock.cuda
    x = torch.randn(256, 8, device="cuda")
    for _ in range(3):
        timer.start_step()
        model(x).sum().backward()
        timer.end_step()
    times = timer.result()
    timer.remove()
    assert (times.forward_ms > 0).all() and times.forward_ms.sum() <= times.step_ms
    assert times.layers[int(times.forward_ms.argmax())] == "3"


class _TimedSteps(pl.Callback):
    """After the LayerTimeCallback's batch start: which optimizer steps it times."""

    def __init__(self, watched: LayerTimeCallback) -> None:
        self.watched = watched
        self.timed: list[int] = []
        self.steps: list[int] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        timer = self.watched._timer
        assert isinstance(timer, LayerTimer)
        if timer.sampling:
            self.timed.append(trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.steps.append(self.watched._timer.result().steps)


def test_cadence_counts_optimizer_steps_under_gradient_accumulation(
    trainer_factory: Any, tmp_path: Path
) -> None:
    callback = LayerTimeCallback(chart=False)  # default cadence: the Trainer's log_every_n_steps
    probe = _TimedSteps(callback)
    # 6 batches, 2 per optimizer step: steps 0, 1, 2; logging steps: 0 (the epoch's first) and 1
    trainer_factory(
        callbacks=[callback, probe], accumulate_grad_batches=2, log_every_n_steps=2
    ).fit(HeavyNet())
    assert probe.timed == [0, 0, 1, 1]  # both micro-batches of steps 0 and 1, none of step 2
    assert probe.steps == [1, 1, 2, 2, 2, 2]  # steps timed so far, after each batch
    calls = read_scalars(tmp_path)["layer_time/forward_ms/net.0"]
    assert [step for step, _ in calls] == [epoch_end_step(3)]


class _TimerMemory(pl.Callback):
    """Bytes allocated by ``core/stats/layer_time.py`` and still held, at batches 5 and 35."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        batch = trainer.global_step
        if batch == 5:
            tracemalloc.start()
        if batch in (5, 35):
            snapshot = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(True, "*lightning_hooks/core/stats/layer_time.py")]
            )
            self.held[batch] = sum(stat.size for stat in snapshot.statistics("filename"))
        if batch == 35:
            tracemalloc.stop()


def test_memory_stays_flat_when_every_step_is_timed(trainer_factory: Any) -> None:
    probe = _TimerMemory()
    model = HeavyNet()
    loader = DataLoader(TensorDataset(torch.randn(40, 8), torch.randn(40, 1)), batch_size=1)
    model.train_dataloader = lambda: loader  # type: ignore[method-assign]
    trainer_factory(callbacks=[LayerTimeCallback(every_n_steps=1, chart=False), probe]).fit(model)
    assert set(probe.held) == {5, 35}
    # The marks are dropped as they are read, not kept until the epoch ends (about 700 bytes a
    # step, 21 kB here).
    assert probe.held[35] - probe.held[5] < 1000, probe.held


def test_the_clock_follows_where_the_model_says_it_runs() -> None:
    """A module that says where it runs (a LightningModule's ``device``) is timed there, even
    with no parameter on that device; another module runs where its parameters are."""
    from lightning_hooks.core.stats.layer_time import _runs_on_cuda

    class OnCuda(nn.Module):
        @property
        def device(self) -> torch.device:
            return torch.device("cuda", 0)

    assert _runs_on_cuda(OnCuda())
    assert not _runs_on_cuda(nn.Linear(2, 2))
    assert not _runs_on_cuda(nn.ReLU())
