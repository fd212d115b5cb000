"""A 2-process CPU DDP fit (gloo) of every LayerStat callback, run as a script by
test_stats_ddp.py: the user-defined ``OutputRMS`` of ``examples/custom_stat.py`` through
``StatsCallback``, and the activation, dead-unit and saturation callbacks. Each rank writes the
collectives our package made per epoch into ``rank{r}.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import runpy
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist
from collectives import CollectiveCounter
from ddp_run import SAMPLES, DeepMLP, trainer_options
from torch import nn

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
    trainer.fit(DeepMLP(depth=3, batch_size=SAMPLES // 4 // devices))
    counter.restore()
    return counter


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    counter = fit(args.out, devices=2)
    report = {"epochs": counter.epochs, "ours": dict(counter.ours), "rank": dist.get_rank()}
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
