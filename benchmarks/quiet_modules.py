"""Which of our modules a quiet step runs, counted with ``sys.setprofile`` over steps 20-29.

On the launch-bound stand-in (``overhead._launch``: 73 modules), a quiet step (not a logging
step, the Trainer's ``log_every_n_steps`` at 50) with ``GradFlowCallback()`` alone and with the
five per-step callbacks at their defaults; per configuration the modules of ``lightning_hooks``
whose functions were called and the calls per step::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quiet_modules.py
"""

from __future__ import annotations

import logging
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]

import overhead  # noqa: E402

import lightning_hooks  # noqa: E402

PACKAGE = str(Path(lightning_hooks.__file__).parent)
FIVE = (
    "GradFlowCallback",
    "ActivationStatsCallback",
    "DeadReLUCallback",
    "SaturationCallback",
    "LayerTimeCallback",
)
STEPS = range(20, 30)


class _Modules(pl.Callback):
    """Opens the profile at each batch start of ``STEPS``, closes it at the next batch start."""

    def __init__(self) -> None:
        self.modules: Counter[str] = Counter()
        self.functions: Counter[tuple[str, str]] = Counter()
        self.calls = 0
        self._on = False

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(PACKAGE):
            self.modules[Path(name).relative_to(PACKAGE).as_posix()] += 1
            self.functions[(Path(name).relative_to(PACKAGE).as_posix(), frame.f_code.co_name)] += 1
            self.calls += 1

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        sys.setprofile(None)
        if trainer.global_step in STEPS:
            sys.setprofile(self._profile)

    def on_train_end(self, *args: Any) -> None:
        sys.setprofile(None)


def count(names: tuple[str, ...]) -> _Modules:
    """One fit of 32 steps on the stand-in with the named callbacks after the probe."""
    probe = _Modules()
    net, shape, batch = overhead.MODELS["launch"]
    torch.manual_seed(0)
    model = overhead.Bench(
        net(), torch.randn(batch * 32, *shape), torch.randint(0, 10, (batch * 32,)), batch
    )
    callbacks = [probe, *(getattr(lightning_hooks, n)() for n in names)]
    trainer = pl.Trainer(
        max_steps=32,
        accelerator="cpu",
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        logger=pl.loggers.TensorBoardLogger("/tmp/qm/runs"),
    )
    trainer.fit(model)
    return probe


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    for label, names in (("GradFlowCallback()", FIVE[:1]), ("the five per-step callbacks", FIVE)):
        probe = count(names)
        steps = len(STEPS)
        print(f"{label}: {len(probe.modules)} modules, {probe.calls / steps:.0f} calls a step")
        for module, calls in sorted(probe.modules.items()):
            print(f"  {module}: {calls / steps:.1f}")


if __name__ == "__main__":
    main()
