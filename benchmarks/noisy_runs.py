"""False ``diverging`` warnings on small noisy runs: runs whose per-batch loss swings 2x and that
learn little in their first steps, over many seeds, with and without the rule's noise bar.

- ``examples/quickstart.py``'s model and data (the sum of 16 Gaussians, MSE, Adam at 1e-3, 16
  shuffled batches of 32 an epoch, 3 epochs) through ``Trainer.fit`` with ``GradFlowCallback()``,
  seeded with ``torch.manual_seed(seed)``: the warnings it raised, and the rule replayed on the
  losses it saw without the noise bar (``diverge_noise=0``, the rule before it);
- the same in a plain PyTorch loop over more seeds, and the test suite's ``TinyMLP`` (SGD with
  momentum on 4 fixed batches of 8, 12 steps): the real ``TrainingAlarms`` replayed on the losses.

Usage::

    PYTHONPATH=$PWD python benchmarks/noisy_runs.py   # about 3 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_hooks.core import AlarmRules, TrainingAlarms

ROOT = Path(__file__).resolve().parents[1]
RULES = {"with the noise bar (defaults)": AlarmRules(), "without (diverge_noise=0)": AlarmRules(
    diverge_noise=0.0
)}  # fmt: skip


def _mlp(width_in: int, width: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, 1),
    )  # fmt: skip


def quickstart_losses(seed: int) -> list[float]:
    """The quickstart's run in a plain loop: its 48 training losses."""
    torch.manual_seed(seed)
    net = _mlp(16, 64)
    x = torch.randn(512, 16)
    y = x.sum(1, keepdim=True)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        order = torch.randperm(512)
        for i in range(16):
            idx = order[i * 32 : (i + 1) * 32]
            loss = nn.functional.mse_loss(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
    return losses


def tiny_losses(seed: int) -> list[float]:
    """``tests/conftest.py``'s ``TinyMLP`` on its dataset, 3 epochs of 4 batches."""
    torch.manual_seed(seed)
    net = _mlp(8, 16)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(32, 1, generator=g)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(3):
        for i in range(4):
            loss = nn.functional.mse_loss(net(x[i * 8 : (i + 1) * 8]), y[i * 8 : (i + 1) * 8])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
    return losses


def fired(losses: list[float], rules: AlarmRules) -> list[int]:
    """Steps of the real every-step check's *diverging* alarms on ``losses``."""
    alarms = TrainingAlarms(["global"], rules)
    steps = []
    for step, loss in enumerate(losses):
        alarms.update_loss(torch.tensor(loss), step=step)
        steps += [a.step for a in alarms.poll() if a.rule == "diverging"]
    return steps


def quickstart_fit(seed: int) -> tuple[list[float], list[int]]:
    """The quickstart through ``Trainer.fit``: its losses and its *diverging* warnings' steps."""
    import pytorch_lightning as pl
    from pytorch_lightning.loggers import TensorBoardLogger
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hooks import GradFlowCallback
    from lightning_hooks.errors import TrainingAlarmWarning

    sys.path.insert(0, str(ROOT / "examples"))
    from quickstart import Regressor

    class Recorded(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.losses: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.losses.append(float(loss))
            return loss

    torch.manual_seed(seed)
    x = torch.randn(512, 16)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32, shuffle=True)
    with tempfile.TemporaryDirectory() as logdir:
        trainer = pl.Trainer(
            max_epochs=3,
            accelerator="cpu",
            logger=TensorBoardLogger(logdir, name="quickstart"),
            callbacks=[GradFlowCallback()],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        model = Recorded()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer.fit(model, data)
    warned = [
        w.message.alarm.step  # type: ignore[union-attr]
        for w in record
        if issubclass(w.category, TrainingAlarmWarning) and "diverging" in str(w.message)
    ]
    return model.losses, warned


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fit-seeds", type=int, default=30)
    parser.add_argument("--quickstart-seeds", type=int, default=100)
    parser.add_argument("--tiny-seeds", type=int, default=300)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "noisy_runs"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    runs: dict[str, list[list[float]]] = {}
    fits = [quickstart_fit(seed) for seed in range(args.fit_seeds)]
    runs["quickstart through Trainer.fit"] = [losses for losses, _ in fits]
    live = [seed for seed, (_, warned) in enumerate(fits) if warned]
    runs["quickstart, plain loop"] = [quickstart_losses(s) for s in range(args.quickstart_seeds)]
    runs["TinyMLP, plain loop"] = [tiny_losses(s) for s in range(args.tiny_seeds)]
    table = {
        kind: {
            name: [seed for seed, run in enumerate(losses) if fired(run, rules)]
            for name, rules in RULES.items()
        }
        for kind, losses in runs.items()
    }
    out = {
        "command": "PYTHONPATH=$PWD python benchmarks/noisy_runs.py",
        "defaults": asdict(AlarmRules()),
        "warned_live": live,
    }
    out["warned_seeds"] = table
    out["runs"] = {kind: len(losses) for kind, losses in runs.items()}
    lines = [
        "Seeds whose run raised a `diverging` warning (of the seeds run):",
        "",
        "| runs | " + " | ".join(RULES) + " |",
        "| --- |" + " --- |" * len(RULES),
    ]
    for kind, by_rule in table.items():
        cells = [f"{len(seeds)} of {out['runs'][kind]}" for seeds in by_rule.values()]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines += ["", f"Warned live through `Trainer.fit` (today's defaults): {len(live)} seeds {live}"]
    target = Path(args.out)
    target.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    target.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
