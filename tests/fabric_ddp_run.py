"""A Fabric loop with GradFlowCallback: 2 CPU processes under DDP (gloo), or one on the global
batch (``--devices 1``); run as a script by test_fabric_ddp.py.

Fabric's launcher re-runs this script for rank 1, so everything happens under ``main()``. Each
step's global batch of 8 is split in halves, rank ``r`` taking rows ``4r .. 4r + 3``; the loss
is each rank's mean, so DDP's averaged gradient is the one process's on the global batch. The
gradients are clipped (``fabric.clip_gradients``) and the loss fed with ``fabric.call``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from ddp_run import exit_cleanly
from lightning.fabric import Fabric
from lightning.fabric.loggers import TensorBoardLogger
from torch import nn

from lightning_hooks import GradFlowCallback

STEPS = 6
MAX_NORM = 0.3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    devices = args.devices
    fabric = Fabric(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        callbacks=[GradFlowCallback(every_n_steps=2)],
        loggers=[TensorBoardLogger(str(args.out), name="tb", version=0)],
    )
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    rows = (
        slice(None) if devices == 1 else slice(4 * fabric.global_rank, 4 * fabric.global_rank + 4)
    )
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        fabric.call("on_before_backward", loss)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
    fabric.call("on_train_epoch_end")
    fabric.call("on_train_end")


if __name__ == "__main__":
    main()
    exit_cleanly()
