"""A run to kill: one endless epoch, ``log_every_n_steps=10``, the default callbacks, and the
true gradient norm of each layer at each logging step written to a side file as it goes.

    python tests/killed_run.py --out DIR   # TensorBoard under DIR/tb, truth in DIR/truth.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from long_epoch import Regressor, Stream

from lightning_hooks import ActivationStatsCallback, DeadReLUCallback, GradFlowCallback

EVERY = 10
LAYERS = ("net.0", "net.2", "net.4")


class Truth(pl.Callback):
    """Plain torch gradient norms of the logging steps (``(s + 1) % 10 == 0`` and step 0)."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("w")

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        step = trainer.global_step
        if (step + 1) % EVERY and step:
            return
        norms = {}
        for name in LAYERS:
            grads = [p.grad.flatten() for p in pl_module.get_submodule(name).parameters()]
            norms[name] = float(torch.linalg.vector_norm(torch.cat(grads)))
        self.file.write(json.dumps({"step": step, "grad_norm": norms}) + "\n")
        self.file.flush()

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(0.01)  # tiny steps: slow enough to be killed mid-epoch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    torch.manual_seed(0)
    trainer = pl.Trainer(
        max_steps=100_000,
        log_every_n_steps=EVERY,
        accelerator="cpu",
        logger=TensorBoardLogger(str(out), name="tb", version=0),
        callbacks=[
            GradFlowCallback(),
            ActivationStatsCallback(),
            DeadReLUCallback(),
            Truth(out / "truth.jsonl"),
        ],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), DataLoader(Stream(batch=8), batch_size=None))


if __name__ == "__main__":
    main()
