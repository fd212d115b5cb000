"""Faults injected on rank 1 only, 2 CPU processes (gloo), run as a script by
test_distributed_fault_agreement.py.

``python tests/fault_run.py --out DIR --strategy ddp|fsdp``: Lightning's launcher re-runs this
script for rank 1, so everything happens under ``main()``. Every fit trains 2 epochs of 4
optimizer steps with the statistics every 4th step (logging steps 0, 3, 4 and 7: each epoch's
first step and every 4th), and one fault: a function of the library replaced, on rank 1 only, by
one that raises ``RuntimeError("injected ...")`` at the steps ``FAULTS`` gives. A fault at a
quiet step keeps raising at every later step (a persistent bug); the others raise once. Each rank
writes ``rank{r}.json``: per fit, the step at which the callback was disabled, the guard's cause,
the warnings of the library on that rank, the final ``global_step`` and the collectives of the
library per batch. A fit that hangs would keep the launch from ending:
test_distributed_fault_agreement.py kills the whole process group at its time limit and fails.

Fits (``GradFlowCallback`` with its default alarms unless said):

- ``healthy``, ``stats_healthy``, ``stop_healthy_no_loss``: no fault (the collectives of a
  fit without one: ``GradFlowCallback``, a ``StatsCallback``, ``on_alarm="stop"`` without a
  loss rule);
- ``quiet``: the gradient alarms' update (``on_before_optimizer_step``) from step 1 on;
- ``quiet_no_loss``: the same with no loss rule (nothing carried per batch);
- ``logging``: the write of logging step 3's values (after its collectives);
- ``loss``: the loss rules at step 2;
- ``epoch_end``: the alarms' epoch end of epoch 0 (after the epoch's collectives);
- ``output_grad``: the output-gradient tensor hook, in the backward of logging step 3;
- ``optimizer_hook``: the optimizer's step post-hook at logging step 3;
- ``stop`` / ``stop_no_loss``: ``on_alarm="stop"`` with an alarm only rank 1 reads, at step 2;
- ``stats_logging``, ``stats_write``, ``stats_epoch_end``: a ``StatsCallback`` with a statistic
  of the test's own (a packed collective per logging step and per epoch end), its forward hook
  at step 3, its host summary of step 0, its epoch end's host part of epoch 0;
- ``gan`` (DDP): Lightning's GAN recipe (manual optimization, two optimizers,
  ``toggle_optimizer``) returning its loss on every rank, rank 1's ``OFFSET`` higher from
  batch ``JUMP`` on: the loss rules read the mean and fire on both ranks;
- ``manual_skip`` (DDP): manual optimization whose rank 1 returns no loss: the loss rules turn
  off on both ranks at the first batch.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from collectives import CollectiveCounter, LossReading
from ddp_run import AlarmLog, DeepMLP, ManualSkip, exit_cleanly, trainer_options
from fsdp_run import ShardedMLP
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

EVERY = 4
JUMP = 3  # the GAN's batch from which rank 1's loss is OFFSET higher (after diverge_early)
OFFSET = 20.0
Trainer = dict[str, Any]  # holds the running trainer for the fault's condition


def peak_stat() -> Any:
    """A user's statistic: the largest ``|output|`` of every Linear (one packed collective)."""
    from lightning_hooks.core.hooks.selection import Selection
    from lightning_hooks.core.stats.stat import LayerStat

    class LinearPeak(LayerStat[dict[str, float]]):
        def __init__(self) -> None:
            super().__init__(Selection.of("LinearPeak", types=nn.Linear))
            self.add_layer_state("peak", reduce="max")

        def observe(self, name: str, module: nn.Module, output: Any) -> None:
            row = self.row(name)
            self.peak[row] = torch.maximum(self.peak[row], output.detach().abs().max())

        def summarize(self, states: dict[str, Any]) -> dict[str, float]:
            return dict(zip(self.layers, states["peak"].tolist(), strict=True))

        def tags(self, result: dict[str, float]) -> dict[str, float]:
            return {f"peak/{k}": v for k, v in result.items()}

    return LinearPeak()


class GAN(pl.LightningModule):
    """Lightning's GAN recipe, tiny: manual optimization, one optimizer per network, each
    backward and step between ``toggle_optimizer`` and ``untoggle_optimizer``. Returns the
    discriminator's loss plus the generator's, ``OFFSET`` more on rank 1 from batch ``JUMP``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (real,) = batch
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        bce = nn.functional.binary_cross_entropy_with_logits
        z = torch.randn(real.shape[0], 4)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        step = self.trainer.global_step
        self.toggle_optimizer(opt_g)
        g_loss = bce(self.discriminator(self.generator(z)), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        fake = self.generator(z).detach()
        d_loss = (bce(self.discriminator(real), ones) + bce(self.discriminator(fake), zeros)) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        loss = g_loss.detach() + d_loss.detach()
        if dist.get_rank() == 1 and batch_idx >= JUMP:
            loss = loss + OFFSET
        self.losses[step] = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
        return [opt_g, opt_d], []

    def train_dataloader(self) -> DataLoader[Any]:
        real = torch.randn(32, 2, generator=torch.Generator().manual_seed(5)) * 0.5 + 1.0
        return DataLoader(TensorDataset(real[dist.get_rank() :: 2]), batch_size=4)


@contextmanager
def fault(target: Any, name: str, when: Callable[[], bool]) -> Iterator[None]:
    """``target.name`` raising on rank 1 while ``when()`` holds; restored on exit."""
    original = getattr(target, name)

    def raising(*args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == 1 and when():
            raise RuntimeError(f"injected fault in {name}")
        return original(*args, **kwargs)

    setattr(target, name, raising)
    try:
        yield
    finally:
        setattr(target, name, original)


def one_rank_alarm(held: Trainer) -> Callable[..., Any]:
    """``TrainingAlarms.poll`` that also reads a *nonfinite* alarm at step 2 on rank 1 only."""
    from lightning_hooks.core.alarms import TrainingAlarm, TrainingAlarms

    original = TrainingAlarms.poll

    def poll(self: Any, wait: bool = False) -> list[Any]:
        alarms = list(original(self, wait))
        if dist.get_rank() == 1 and held["trainer"].global_step == 2 and not wait:
            alarms.append(TrainingAlarm("nonfinite", "global", 2, float("nan"), 0.0, "injected"))
        return alarms

    return poll


def faults(name: str, held: Trainer) -> Any:
    """The fault of fit ``name`` (a context manager)."""
    from lightning_hooks.callbacks.attached import Logged
    from lightning_hooks.callbacks.grad_flow_alarms import FitAlarms
    from lightning_hooks.core import GradFlowTracker
    from lightning_hooks.core.alarms import TrainingAlarms
    from lightning_hooks.core.stats import output_grad

    def step() -> int:
        return int(held["trainer"].global_step)

    def epoch() -> int:
        return int(held["trainer"].current_epoch)

    stat = type(held["stat"]) if held.get("stat") is not None else None
    table: dict[str, tuple[Any, str, Callable[[], bool]]] = {
        "quiet": (TrainingAlarms, "update", lambda: step() >= 1),
        "quiet_no_loss": (TrainingAlarms, "update", lambda: step() >= 1),
        "logging": (GradFlowTracker, "step_values", lambda: step() == 4),
        "loss": (TrainingAlarms, "update_loss", lambda: step() == 2),
        "epoch_end": (FitAlarms, "end_epoch", lambda: epoch() == 0),
        "output_grad": (output_grad, "_output_norm", lambda: step() == 3),
        "optimizer_hook": (GradFlowTracker, "_after_step", lambda: step() == 3),
        "stats_logging": (stat, "observe", lambda: step() == 3),
        "stats_write": (stat, "summarize", lambda: step() == 1),
        "stats_epoch_end": (Logged, "write_epoch", lambda: epoch() == 0),
    }
    if name in ("stop", "stop_no_loss"):
        return _patched(TrainingAlarms, "poll", one_rank_alarm(held))
    if name not in table:
        return _patched(None, "", None)
    return fault(*table[name])


@contextmanager
def _patched(target: Any, name: str, value: Any) -> Iterator[None]:
    if target is None:
        yield
        return
    original = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, original)


def callback(name: str, held: Trainer) -> Any:
    """Our callback for fit ``name``."""
    from lightning_hooks import GradFlowCallback, StatsCallback
    from lightning_hooks.core import AlarmRules

    if name.startswith("stats"):
        held["stat"] = peak_stat()
        return StatsCallback(held["stat"], every_n_steps=EVERY)
    no_loss = AlarmRules(diverge_ratio=None) if name.endswith("no_loss") else True
    on_alarm = "stop" if name.startswith("stop") else "warn"
    return GradFlowCallback(chart=False, every_n_steps=EVERY, alarms=no_loss, on_alarm=on_alarm)


def model_for(name: str, strategy: str) -> pl.LightningModule:
    if name == "gan":
        return GAN()
    if name == "manual_skip":
        return ManualSkip()
    return ShardedMLP() if strategy == "fsdp" else DeepMLP(depth=4, batch_size=4)


def fit(root: Path, name: str, strategy: str) -> dict[str, Any]:
    """One 2-process fit with the fault of ``name``: what this rank saw."""
    from lightning_hooks.errors import LightningHooksWarning

    held: Trainer = {}
    ours = callback(name, held)
    counter = CollectiveCounter()
    reading = LossReading(ours)
    log = [AlarmLog(ours)] if name == "gan" else []
    # The GAN's generator backward does not reach the discriminator's parameters.
    chosen: Any = "ddp_find_unused_parameters_true" if name == "gan" else "ddp"
    if strategy == "fsdp":
        chosen = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(
        devices=2,
        strategy=chosen,
        callbacks=[ours, *log, counter, reading],
        **trainer_options(root / name, "tensorboard"),
    )
    held["trainer"] = trainer
    model = model_for(name, strategy)
    with warnings.catch_warnings(record=True) as caught, faults(name, held):
        warnings.simplefilter("always")
        try:
            trainer.fit(model)
        finally:
            counter.restore()
    guard = ours.hook_guard()
    return {
        "disabled_step": getattr(guard, "disabled_step", None),
        "failed": guard.failed,
        "warnings": [
            str(w.message) for w in caught if issubclass(w.category, LightningHooksWarning)
        ],
        "global_step": trainer.global_step,
        "steps": counter.steps,
        "epochs": counter.epochs,
        "loss_reading": reading.reading,
        "alarms": log[0].epochs if log else {},
        "losses": getattr(model, "losses", {}),
    }


FITS = {
    "ddp": (
        "healthy",
        "stats_healthy",
        "stop_healthy_no_loss",
        "quiet",
        "quiet_no_loss",
        "logging",
        "loss",
        "epoch_end",
        "output_grad",
        "optimizer_hook",
        "stop",
        "stop_no_loss",
        "stats_logging",
        "stats_write",
        "stats_epoch_end",
        "gan",
        "manual_skip",
    ),
    "fsdp": (
        "healthy",
        "quiet",
        "quiet_no_loss",
        "logging",
        "loss",
        "epoch_end",
        "stop",
        "stats_logging",
        "stats_epoch_end",
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", choices=tuple(FITS), required=True)
    parser.add_argument("--fits", nargs="*", help="only these fits (default: every one)")
    args = parser.parse_args()
    names = args.fits or FITS[args.strategy]
    report = {}
    for name in names:
        print(f"fit {name} on rank {dist.get_rank() if dist.is_initialized() else 0}", flush=True)
        report[name] = fit(args.out, name, args.strategy)
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    exit_cleanly()
