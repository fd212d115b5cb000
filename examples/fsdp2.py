"""The callbacks under FSDP2: two CPU processes (gloo), every parameter sharded across them.

Lightning's ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` with
``fully_shard`` applied in ``configure_model``: each rank holds half of every parameter and
gradient (``DTensor`` shards). The statistics are still those of the whole model: each rank
measures its shards, and one packed collective per step makes them whole (see the README's
support matrix). Rank 0 writes the logs under ``runs/fsdp2``.

Run: ``python examples/fsdp2.py``. ``python examples/fsdp2.py --time`` instead times a training
step of a wider model (8 x Linear(512, 512) + head, batch 64 per rank, Adam): without callbacks,
with ``GradFlowCallback`` at its defaults, with the sentinel on every step, and with every
gradient statistic on every step, interleaved over 3 rounds; it prints the median step time, and
the median time of the one collective a logging step adds for the gradient statistics.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import ActivationStatsCallback, DeadReLUCallback, GradFlowCallback
from lightning_hooks.core import AlarmRules


class ShardedRegressor(pl.LightningModule):
    def __init__(self, inputs: int = 16, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(inputs, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.Tanh()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 1))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        assert self.device_mesh is not None, "run with ModelParallelStrategy"
        mesh = self.device_mesh["data_parallel"]
        for module in self.net:
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)  # one all-gather / reduce-scatter per layer
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class _StepClock(pl.Callback):
    """Wall time of every training step (forward, backward, statistics, optimizer step)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def _trainer(callbacks: list[pl.Callback], name: str, **options: Any) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        logger=TensorBoardLogger("runs", name=name),
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def train() -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32)
    callbacks: list[pl.Callback] = [
        GradFlowCallback(on_alarm="skip"),  # a non-finite gradient skips the step on every rank
        ActivationStatsCallback(),
        DeadReLUCallback(),
    ]
    trainer = _trainer(callbacks, "fsdp2", max_epochs=2, log_every_n_steps=4)
    trainer.fit(ShardedRegressor(), data)
    if trainer.is_global_zero:
        print("logs in runs/fsdp2; view them with: tensorboard --logdir runs")


def time_steps(rounds: int = 3, steps: int = 30) -> None:
    """Median step time of four setups, interleaved: a noisy neighbour slows each alike."""
    torch.manual_seed(0)
    x = torch.randn(steps * 128, 512)
    data = DataLoader(TensorDataset(x, x[:, :1]), batch_size=128)  # 64 per rank
    setups: dict[str, tuple[Any, int]] = {  # callbacks, log_every_n_steps
        "bare": (list, 50),
        "GradFlowCallback() at defaults": (lambda: [GradFlowCallback(chart=False)], 50),
        "+ sentinel every step": (
            lambda: [GradFlowCallback(chart=False, alarms=AlarmRules(evaluate_every_n_steps=1))],
            50,
        ),
        "every statistic every step": (lambda: [GradFlowCallback(chart=False)], 1),
    }
    medians: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(rounds):
        for name, (make, every) in setups.items():
            clock = _StepClock()
            trainer = _trainer(
                [*make(), clock], "fsdp2_time", max_epochs=1, log_every_n_steps=every
            )
            model = ShardedRegressor(inputs=512, width=512, depth=8)
            trainer.fit(model, data)
            medians[name].append(statistics.median(clock.times[5:]))  # step 0 is a logging step
    reduce_us = _time_shard_reduce(list(model.parameters()))
    if torch.distributed.get_rank() == 0:
        bare = statistics.median(medians["bare"])
        for name, values in medians.items():
            median = statistics.median(values)
            print(f"{name:>32}: {median * 1e3:7.2f} ms/step  {median / bare:.3f}x bare")
        print(f"the step's packed shard reduce alone: {reduce_us:.0f} us per call")


def _time_shard_reduce(params: list[torch.Tensor], calls: int = 200) -> float:
    """Median time of one ``ShardPlan.reduce`` of a logging step's partials (4 per parameter)."""
    from lightning_hooks.core.sharding import ShardPlan

    plan = ShardPlan.from_params(params)
    assert plan is not None
    partials = [torch.rand(len(params)) for _ in range(4)]
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        plan.reduce(norms=partials[:2], sums=partials[2:3], maxima=partials[3:])
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--time", action="store_true", help="time steps instead of training")
    if parser.parse_args().time:
        time_steps()
    else:
        train()
