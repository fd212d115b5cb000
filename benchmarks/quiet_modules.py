"""What a quiet step runs of ours: the modules, the Python calls and the ATen ops beyond bare.

On the launch-bound stand-in (``overhead._launch``: 73 modules), steps 20-29 of a 32-step fit are
quiet (the Trainer's ``log_every_n_steps`` at 50 samples step 0 and step 49 only). Per
configuration, ``GradFlowCallback()`` alone and the five per-step callbacks at their defaults:
the modules of ``lightning_hooks`` whose functions a quiet step calls (``sys.setprofile``), the
calls a step, and the ATen ops a step beyond the same fit without callbacks (a
``TorchDispatchMode``, ``tests/ops.py``)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quiet_modules.py
    PYTHONPATH=/path/to/another/checkout .venv/bin/python benchmarks/quiet_modules.py  # compare
    PYTHONPATH=$PWD .venv/bin/python benchmarks/quiet_modules.py --functions  # which calls
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]

import overhead  # noqa: E402
from ops import OpCounter  # noqa: E402

import lightning_hooks  # noqa: E402

PACKAGE = Path(lightning_hooks.__file__).parent
FIVE = (
    "GradFlowCallback",
    "ActivationStatsCallback",
    "DeadReLUCallback",
    "SaturationCallback",
    "LayerTimeCallback",
)
STEPS = range(20, 30)


class _Probe(pl.Callback):
    """Opens the profile and the op counter at each batch start of ``STEPS``, closes them at
    the next batch start (first in the callback list: the whole step is inside)."""

    def __init__(self) -> None:
        self.functions: Counter[tuple[str, str]] = Counter()
        self.counter = OpCounter()

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        path = Path(frame.f_code.co_filename)
        if event == "call" and path.is_relative_to(PACKAGE):
            self.functions[(path.relative_to(PACKAGE).as_posix(), frame.f_code.co_name)] += 1

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._close()
        if trainer.global_step in STEPS:
            self.counter.start()
            sys.setprofile(self._profile)

    def on_train_end(self, *args: Any) -> None:
        self._close()

    def _close(self) -> None:
        sys.setprofile(None)
        self.counter.stop()


def fit(names: tuple[str, ...]) -> _Probe:
    """One fit of 32 steps on the stand-in with the named callbacks after the probe."""
    probe = _Probe()
    net, shape, batch = overhead.MODELS["launch"]
    torch.manual_seed(0)
    x, y = torch.randn(batch * 32, *shape), torch.randint(0, 10, (batch * 32,))
    with tempfile.TemporaryDirectory() as logdir:
        trainer = pl.Trainer(
            max_steps=32,
            accelerator="cpu",
            callbacks=[probe, *(getattr(lightning_hooks, n)() for n in names)],
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            logger=pl.loggers.TensorBoardLogger(logdir),
        )
        trainer.fit(overhead.Bench(net(), x, y, batch))
    return probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--functions", action="store_true", help="list the functions called")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    steps = len(STEPS)
    bare = fit(()).counter.total
    print(f"lightning_hooks from {PACKAGE}; quiet steps {STEPS.start}-{STEPS.stop - 1}")
    for label, names in (("GradFlowCallback()", FIVE[:1]), ("the five per-step callbacks", FIVE)):
        probe = fit(names)
        modules = Counter[str]()
        for (module, _), calls in probe.functions.items():
            modules[module] += calls
        calls, ops = sum(modules.values()), probe.counter.total - bare
        print(
            f"{label}: {len(modules)} modules, {calls / steps:.0f} calls and "
            f"{ops / steps:.1f} ATen ops a step beyond bare"
        )
        rows = probe.functions if args.functions else modules
        for key, n in sorted(rows.items()):
            print(f"  {':'.join(key) if isinstance(key, tuple) else key}: {n / steps:.1f}")


if __name__ == "__main__":
    main()
