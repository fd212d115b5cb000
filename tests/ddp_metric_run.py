"""2-process CPU DDP fits (gloo) of ``MetricStat(MeanMetric())`` on every Linear layer, run as a
script by test_metric_stat_ddp.py. The model's "expert" layer runs on rank 0 only (a layer some
ranks never meet). Two fits in one launch, of 5 and of 22 Linear layers: each rank writes the
outputs of its layers' training forwards (recorded by hooks of the script's own) into
``outputs{depth}_rank{r}.pt``, and the collectives made per epoch into ``rank{r}.json``, with
what torchmetrics' own sync of the same clones costs. Then, on batches that are all the same
(:class:`SameBatches`), a fit uninterrupted (``--out/whole``), one checkpointed at optimizer step
6 of 8 (``--out/ckpt``), and one resumed from that checkpoint (``--out/resumed``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from collectives import CollectiveCounter
from ddp_run import SAMPLES, DeepMLP, exit_cleanly, trainer_options
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchmetrics import MeanMetric

DEPTHS = (3, 20)
"""Blocks of ``DeepMLP``: with its head and the expert, 5 and 22 Linear layers."""


class OneRankExpert(DeepMLP):
    """``DeepMLP(depth)`` with an "expert" ``Linear(8, 8)`` that rank 0 alone runs."""

    def __init__(self, depth: int, batch_size: int) -> None:
        super().__init__(depth=depth, batch_size=batch_size)
        self.expert = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.global_rank == 0:
            x = x + self.expert(x)
        return self.net(x)  # type: ignore[no-any-return]


class SameBatches(OneRankExpert):
    """``OneRankExpert(3)`` whose global batches all hold the same 8 samples, 4 on each rank: a
    batch replayed after a mid-epoch resume is the same data."""

    def __init__(self) -> None:
        super().__init__(DEPTHS[0], batch_size=SAMPLES // 4 // 2)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(8, 8, generator=g).repeat(SAMPLES // 8, 1)
        data = TensorDataset(x, x[:, :1])
        sampler = DistributedSampler(data, shuffle=False)  # rank r: samples r, r + 2, ...
        return DataLoader(data, batch_size=self.batch_size, sampler=sampler)


class Recorder:
    """Every training output of the model's Linear layers, in call order, by plain hooks."""

    def __init__(self, model: nn.Module) -> None:
        self.outputs: dict[str, list[torch.Tensor]] = {}
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if module.training and torch.is_grad_enabled():
                self.outputs.setdefault(name, []).append(output.detach().clone())

        return hook


def fit(root: Path, depth: int) -> tuple[CollectiveCounter, Recorder]:
    """One 2-process fit of :class:`OneRankExpert`; logs under ``root``."""
    from lightning_hooks import MetricStat, StatsCallback

    model = OneRankExpert(depth, batch_size=SAMPLES // 4 // 2)
    recorder = Recorder(model)
    counter = CollectiveCounter()
    stat = MetricStat(MeanMetric(), name="output_mean", types=nn.Linear)
    trainer = pl.Trainer(
        devices=2,
        strategy="ddp_find_unused_parameters_true",
        callbacks=[StatsCallback(stat), counter],
        **trainer_options(root, "tensorboard"),
    )
    trainer.fit(model)
    counter.restore()
    return counter, recorder


def same_batches_fit(root: Path, *extra: pl.Callback, ckpt_path: Path | None = None) -> None:
    """One 2-process fit of :class:`SameBatches`; logs under ``root``."""
    from lightning_hooks import MetricStat, StatsCallback

    stat = MetricStat(MeanMetric(), name="output_mean", types=nn.Linear)
    options = {**trainer_options(root, "tensorboard"), "enable_checkpointing": bool(extra)}
    trainer = pl.Trainer(
        devices=2,
        strategy="ddp_find_unused_parameters_true",
        callbacks=[StatsCallback(stat), *extra],
        **options,
    )
    trainer.fit(SameBatches(), ckpt_path=ckpt_path)


def torchmetrics_own_sync(layers: int) -> dict[str, int]:
    """The collectives of ``compute`` on ``layers`` updated ``MeanMetric`` clones, each synced
    by torchmetrics itself."""
    clones = [MeanMetric() for _ in range(layers)]
    for clone in clones:
        clone.update(torch.ones(3))
    counter = CollectiveCounter()
    for clone in clones:
        clone.compute()
    counter.restore()
    return dict(counter.all)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    report: dict[str, Any] = {}
    for depth in DEPTHS:  # the second fit reuses the process group
        counter, recorder = fit(args.out / f"depth{depth}", depth)
        rank = dist.get_rank()
        torch.save(recorder.outputs, args.out / f"outputs{depth}_rank{rank}.pt")
        report[f"depth{depth}"] = {
            "layers": len(recorder.outputs),
            "epochs": [e["ours_by_name"] for e in counter.epochs],
            "ours": dict(counter.ours),
            "torchmetrics": torchmetrics_own_sync(depth + 2),
        }
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    same_batches_fit(args.out / "whole")
    saving = ModelCheckpoint(args.out / "ckpt", every_n_train_steps=6, save_top_k=-1)
    same_batches_fit(args.out / "first", saving)
    again = ModelCheckpoint(args.out / "ckpt", every_n_train_steps=6, save_top_k=-1)
    same_batches_fit(
        args.out / "resumed", again, ckpt_path=args.out / "ckpt" / "epoch=1-step=6.ckpt"
    )


if __name__ == "__main__":
    main()
    exit_cleanly()
