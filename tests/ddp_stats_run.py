"""A 2-process CPU DDP fit (gloo) of every LayerStat callback, run as a script by
test_stats_ddp.py: the user-defined ``OutputRMS`` of ``examples/custom_stat.py`` through
``StatsCallback``, the activation, dead-unit and saturation callbacks, and ``StabilityStats``
(the attention of a 2-head ``scaled_dot_product_attention`` layer in front of the MLP, and the
output logits); then, under ``--out/routed``, a fit whose "expert" layer runs on one rank
before the other (:class:`RoutedMLP`). Each rank writes the collectives our package made per
epoch into ``rank{r}.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import runpy
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from collectives import CollectiveCounter
from ddp_run import SAMPLES, DeepMLP, exit_cleanly, trainer_options
from torch import nn
from torch.nn import functional

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_stat.py"


def callbacks() -> list[pl.Callback]:
    """The callbacks under test, fresh."""
    from lightning_hooks import ActivationStatsCallback, DeadReLUCallback, SaturationCallback
    from lightning_hooks.callbacks.stats import StatsCallback
    from lightning_hooks.core.stats.stability import StabilityStats

    output_rms: Any = runpy.run_path(str(EXAMPLE))["OutputRMS"]
    return [
        StatsCallback([output_rms()]),
        ActivationStatsCallback(heatmaps=False),
        DeadReLUCallback(types=nn.Tanh, warn_at=None),
        SaturationCallback(margin=0.2, warn_at=None),
        StatsCallback([StabilityStats()]),  # the output logits' log Z: sum/count and max
    ]


class SelfAttention(nn.Module):
    """The 8 features as a sequence of 4 tokens of 2, 2 heads of width 1, bidirectional."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(2, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x.view(-1, 4, 2)).view(-1, 4, 3, 2, 1).permute(2, 0, 3, 1, 4)
        return functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(1)


class AttentionMLP(DeepMLP):
    """``DeepMLP(depth=3)`` with a residual :class:`SelfAttention` in front."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(depth=3, batch_size=batch_size)
        self.attn = SelfAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x + 4 * self.attn(x))  # type: ignore[no-any-return]


class RoutedMLP(DeepMLP):
    """``DeepMLP(depth=3)`` with an "expert" that only the samples whose first feature is above
    1.5 go through (a mixture-of-experts router's shape): on 2 ranks, step 0's only such sample
    is rank 0's, steps 1 and 2's rank 1's, so a rank meets the expert after the other."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(depth=3, batch_size=batch_size)
        self.expert = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = x[:, 0] > 1.5
        if routed.any():  # data-dependent: a host read, as routers make
            x = x.clone()
            x[routed] = x[routed] + self.expert(x[routed])
        return self.net(x)  # type: ignore[no-any-return]


def routed_fit(root: Path, devices: int) -> None:
    """One fit of :class:`RoutedMLP` with ``ActivationStatsCallback``; logs under ``root``."""
    from lightning_hooks import ActivationStatsCallback

    strategy = {"strategy": "ddp_find_unused_parameters_true"} if devices > 1 else {}
    trainer = pl.Trainer(
        devices=devices,
        callbacks=[ActivationStatsCallback(heatmaps=False)],
        **strategy,
        **trainer_options(root, "tensorboard"),
    )
    trainer.fit(RoutedMLP(batch_size=SAMPLES // 4 // devices))


def fit(root: Path, devices: int) -> CollectiveCounter:
    """One fit of ``DeepMLP(depth=3)``; logs under ``root``."""
    counter = CollectiveCounter()
    strategy = {"strategy": "ddp"} if devices > 1 else {}
    trainer = pl.Trainer(
        devices=devices,
        callbacks=[*callbacks(), counter],
        **strategy,
        **trainer_options(root, "tensorboard"),
    )
    trainer.fit(AttentionMLP(batch_size=SAMPLES // 4 // devices))
    counter.restore()
    return counter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    routed_fit(args.out / "routed", devices=2)
    counter = fit(args.out, devices=2)
    report = {"epochs": counter.epochs, "ours": dict(counter.ours), "rank": dist.get_rank()}
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    exit_cleanly()
