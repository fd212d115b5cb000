"""What a logging step costs, in quiet steps of the same fit, per callback at its defaults.

At the defaults each callback measures one step in ``log_every_n_steps`` (50): its per-module
hooks run on that step only, and their cost reaches the mean step once in 50. Where the host is
shared, step times swing between fits; within one fit the logging steps and the quiet steps see
the same host. Per configuration, the median wall time of the logging steps (49, 99, ...) and
of the quiet steps, and their ratio, over the fits of ``--rounds`` interleaved rounds on the
launch-bound stand-in (``overhead._launch``), one torch thread::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/logging_step.py
    PYTHONPATH=/path/to/another/checkout .venv/bin/python benchmarks/logging_step.py  # compare
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]

import overhead  # noqa: E402

import lightning_hooks  # noqa: E402


class _Clock(pl.Callback):
    """Each step's start."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())


def measure(callbacks: list[pl.Callback], steps: int, model: str) -> tuple[float, float]:
    """Median logging step and median quiet step of one fit (ms)."""
    clock = _Clock()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        overhead.fit(model, [clock, *callbacks], steps)
    step = [(b - a) * 1e3 for a, b in zip(clock.starts, clock.starts[1:], strict=False)]
    logging_step = [step[i] for i in range(49, len(step), 50)]
    quiet = [t for i, t in enumerate(step) if i > 3 and i % 50 not in (0, 48, 49)]
    return statistics.median(logging_step), statistics.median(quiet)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="launch", choices=list(overhead.MODELS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    found = overhead.discovered()
    configs = {"all at their defaults": lambda: [cls() for cls in found.values()]}
    configs.update({name: (lambda c=cls: [c()]) for name, cls in found.items()})
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, make in configs.items():
            rows[name].append(measure(make(), args.steps, args.model))
    print(f"lightning_hooks from {Path(lightning_hooks.__file__).parent}")
    print(
        f"model {args.model}, {args.steps} steps, {args.rounds} rounds, torch {torch.__version__}"
    )
    print("| configuration | logging step | quiet step | logging / quiet |")
    print("| --- | --- | --- | --- |")
    for name, runs in rows.items():
        logging_step = statistics.median(s for s, _ in runs)
        quiet = statistics.median(q for _, q in runs)
        ratio = statistics.median(s / q for s, q in runs)
        print(f"| {name} | {logging_step:.1f} ms | {quiet:.2f} ms | {ratio:.1f}x |")


if __name__ == "__main__":
    main()
