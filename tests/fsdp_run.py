"""FSDP2 on 2 CPU processes (gloo): every callback, run as a script by test_fsdp.py.

Lightning's ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` with
``fully_shard`` applied in ``configure_model``: parameters and gradients are ``DTensor``s, each rank
holding a ``[rows / 2, ...]`` shard; ``Linear(3, 1)`` gives rank 1 empty shards. Lightning's
launcher re-runs this script for rank 1, so everything happens under ``main()``. Fits in one
launch, each writing TensorBoard events under ``--out/<name>``:

- ``fsdp``: 1-D mesh, every statistic (gradient flow with histograms, activations with histograms,
  dead units, saturation); collectives counted per step and per epoch, from our package and all;
- ``hsdp``: the same on the 2-D ``(replicate=2, shard=1)`` mesh: replicas must not count twice;
- ``clip``: gradient flow with ``accumulate_grad_batches=2`` and ``gradient_clip_val=0.5``;
- ``skip`` and ``stop``: a NaN written into one gradient entry, which only rank 0's shard holds,
  at step ``NAN_STEP``, with ``on_alarm="skip"`` (statistics every 4th step, the every-step check's
  norm-only pass between) / ``"stop"`` (every statistic at every step); each rank saves its final
  weights and ``global_step`` (``rank{r}.json``);
- ``example``: ``examples/fsdp2.py``'s training (logs under ``--out/example/runs``);
- ``tensor_parallel``: ``tensor_parallel_size=2`` must be refused at setup (the message is kept).

Each rank gets half of each global batch of 8 (a ``DistributedSampler`` without shuffling), so
``run(..., devices=1)`` sees the same global batches in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from collectives import CollectiveCounter
from ddp_run import exit_cleanly, regression_loader
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.loggers import TensorBoardLogger
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader

GLOBAL_BATCH = 8
NAN_STEP = 5
RUNS = ("fsdp", "hsdp", "clip", "skip", "stop")
CLIP: dict[str, Any] = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}


class ShardedMLP(pl.LightningModule):
    """Linear(8, 16) ReLU Linear(16, 3) Tanh Linear(3, 1), MSE loss; ``fully_shard`` per Linear.

    ``mesh``: ``"fsdp"`` shards over the ``data_parallel`` dimension of Lightning's mesh;
    ``"hsdp"`` passes the 2-D ``(data_parallel, tensor_parallel)`` mesh, which ``fully_shard``
    treats as (replicate, shard). ``nan_step``: write NaN into ``net.0.weight.grad[0, 0]`` (rank
    0's shard) after that step's backward.
    """

    def __init__(self, mesh: str = "fsdp", nan_step: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3), nn.Tanh(), nn.Linear(3, 1)
        )
        self.mesh = mesh
        self.nan_step = nan_step

    def configure_model(self) -> None:
        if self.device_mesh is None:  # one process: nothing to shard
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"] if self.mesh == "fsdp" else self.device_mesh
        for module in self.net:
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def on_after_backward(self) -> None:
        # FSDP2 has reduce-scattered the gradients: the callbacks' on_before_optimizer_step (which
        # Lightning runs before the module's own) sees the NaN.
        if self.trainer.global_step != self.nan_step:
            return
        grad = self.net[0].weight.grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if not dist.is_initialized() or dist.get_rank() == 0:
            local[0, 0] = torch.nan

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        batch = GLOBAL_BATCH // (dist.get_world_size() if dist.is_initialized() else 1)
        return regression_loader(batch)


def callbacks(run: str) -> list[pl.Callback]:
    """Our callbacks for ``run``: every statistic for fsdp/hsdp, the alarms for skip/stop."""
    from lightning_hooks import (
        ActivationStatsCallback,
        DeadReLUCallback,
        GradFlowCallback,
        SaturationCallback,
    )
    from lightning_hooks.core import AlarmRules

    if run == "skip":
        # Statistics every 4th step (0 and 4), the every-step check's norm-only pass at every other
        # step (NAN_STEP is one of those).
        every_step = AlarmRules(evaluate_every_n_steps=1)
        return [GradFlowCallback(on_alarm=run, chart=False, every_n_steps=4, alarms=every_step)]
    if run == "stop":  # every statistic at every step: the NaN step is counted in grad_nonfinite
        # The gradient rules only: what is compared is the stop at the NaN's step.
        rules = AlarmRules(diverge_ratio=None)
        return [GradFlowCallback(on_alarm=run, chart=False, alarms=rules)]
    if run == "clip":  # + the gradient norm after clipping, read in the optimizer's post-hook
        return [GradFlowCallback(chart=False)]
    return [
        GradFlowCallback(histograms=True, chart=False),
        ActivationStatsCallback(histograms=True, histogram_range=(-2.0, 2.0), heatmaps=False),
        DeadReLUCallback(),
        SaturationCallback(),
    ]


def run(root: Path, name: str, devices: int, tensor_parallel: int = 1) -> dict[str, Any]:
    """One fit of ``ShardedMLP`` for run ``name``, logging under ``root / name``."""
    counter = CollectiveCounter()
    strategy: dict[str, Any] = {}
    if devices > 1:
        strategy["strategy"] = ModelParallelStrategy(
            data_parallel_size=devices // tensor_parallel, tensor_parallel_size=tensor_parallel
        )
    trainer = pl.Trainer(
        devices=devices,
        accelerator="cpu",
        callbacks=[*callbacks(name), counter],
        max_epochs=2,
        logger=TensorBoardLogger(str(root / name), name="tb", version=0),
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,  # the callbacks' default cadence: every step is compared
        use_distributed_sampler=False,
        **strategy,
        **(CLIP if name == "clip" else {}),
    )
    nan_step = NAN_STEP if name in ("skip", "stop") else -1
    model = ShardedMLP(mesh="hsdp" if name == "hsdp" else "fsdp", nan_step=nan_step)
    try:
        trainer.fit(model)
    finally:
        counter.restore()
    weights = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist()
        for n, p in model.named_parameters()
    }
    placements = {n: str(getattr(p, "placements", None)) for n, p in model.named_parameters()}
    return {
        "steps": counter.steps,
        "epochs": counter.epochs,
        "ours": dict(counter.ours),
        "global_step": trainer.global_step,
        "weights": weights,
        "placements": placements,
    }


def compare(out: Path) -> None:
    """Print every tag of the one-process reference next to the FSDP2 and HSDP runs in ``out``.

    Run after the 2-process launch: ``python tests/fsdp_run.py --out DIR`` then
    ``python tests/fsdp_run.py --out DIR --compare``.
    """
    from conftest import read_scalars

    run(out / "single", "fsdp", devices=1)
    want = read_scalars(out / "single" / "fsdp" / "tb")
    got = {mesh: read_scalars(out / mesh / "tb") for mesh in ("fsdp", "hsdp")}
    print("| tag | step | one process | FSDP2 | HSDP | max rel. diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tag in sorted(want):
        for i, (step, value) in enumerate(want[tag]):
            other = [got[mesh][tag][i][1] for mesh in ("fsdp", "hsdp")]
            diff = max(abs(v - value) / max(abs(value), 1e-12) for v in other)
            cells = " | ".join(f"{v:.6g}" for v in (value, *other))
            print(f"| {tag} | {step} | {cells} | {diff:.1e} |")


def _refused_layouts() -> dict[str, str]:
    """``ShardPlan.from_params``'s errors on real DTensors: a plain parameter beside sharded ones,
    a parameter sharded over two mesh dimensions (FSDP + tensor parallel)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_hooks.core.sharding import ShardPlan

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b"))
    sharded = distribute_tensor(torch.ones(4, 2), mesh["a"], [Shard(0)])
    two_dims = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0), Shard(1)])
    errors = {}
    for name, params in (("mixed", [sharded, torch.ones(3)]), ("two_dims", [two_dims])):
        try:
            ShardPlan.from_params(params)
        except ValueError as err:
            errors[name] = str(err)
    return errors


def _run_example(cwd: Path) -> None:
    """``examples/fsdp2.py``'s training in this launch (its logs go to ``cwd / "runs"``)."""
    cwd.mkdir(exist_ok=True)
    previous = Path.cwd()
    os.chdir(cwd)
    try:
        example = runpy.run_path(str(Path(__file__).parents[1] / "examples" / "fsdp2.py"))
        example["train"]()
    finally:
        os.chdir(previous)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compare", action="store_true", help="print the tag-by-tag table")
    args = parser.parse_args()
    if args.compare:
        compare(args.out)
        return
    report: dict[str, Any] = {name: run(args.out, name, devices=2) for name in RUNS}
    report["rank"] = dist.get_rank()
    report["world_size"] = dist.get_world_size()
    report["backend"] = dist.get_backend()
    _run_example(args.out / "example")
    report["refused_layouts"] = _refused_layouts()
    try:  # last: the refusal ends this fit inside Lightning's exception handling
        run(args.out, "tensor_parallel", devices=2, tensor_parallel=2)
    except MisconfigurationException as err:
        report["tensor_parallel"] = str(err)
    (args.out / f"rank{report['rank']}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    exit_cleanly()
