"""Where a logging step's time goes: a cProfile of logging steps with every callback at its
defaults on the launch-bound stand-in (``overhead._launch``), one torch thread.

The Trainer's ``log_every_n_steps`` is 1 here, so every step is a logging step; steps
``--skip`` to ``--skip + --steps`` are profiled (the fit's set-up and first windows are not).
Prints the functions by cumulative and by own time over the logging steps (cProfile's cost per
call inflates Python-heavy code); ``--phases`` instead times each phase of the logging steps and
the quiet steps of a fit at the Trainer's defaults, on the clock::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_logging_step.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_logging_step.py --only GradFlowCallback
    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_logging_step.py --phases 1500  # real times
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

sys.path[:0] = [str(Path(__file__).parent)]

import overhead  # noqa: E402


class _Profiled(pl.Callback):
    """First in the list: profiles whole steps ``skip`` to ``skip + steps``."""

    def __init__(self, skip: int, steps: int) -> None:
        self.profile = cProfile.Profile()
        self.window = range(skip, skip + steps)
        self._on = False

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._switch(trainer.global_step in self.window)

    def on_train_end(self, *args: Any) -> None:
        self._switch(False)

    def _switch(self, on: bool) -> None:
        if on and not self._on:
            self.profile.enable()
        elif self._on and not on:
            self.profile.disable()
        self._on = on


_MARKS = ("batch start", "forward", "backward", "after backward", "optimizer step", "batch end")


class _Marks(pl.Callback):
    """Each step's clock readings at the phase boundaries; two instances, first and last in the
    list, so that a phase starts after the last callback's hook and ends before the first's."""

    def __init__(self, first: bool, times: list[list[float]]) -> None:
        self.first, self.times = first, times

    def _mark(self, slot: int) -> None:
        if slot == 0:
            self.times.append([0.0] * len(_MARKS))
        if self.times:
            self.times[-1][slot] = time.perf_counter()

    def on_train_batch_start(self, *args: Any) -> None:
        self._mark(0 if self.first else 1)

    def on_before_backward(self, *args: Any) -> None:
        if self.first:
            self._mark(2)

    def on_after_backward(self, *args: Any) -> None:
        self._mark(3 if self.first else 4)

    def on_train_batch_end(self, *args: Any) -> None:
        if self.first:
            self._mark(5)


def phases(names: list[str], model: str, steps: int) -> None:
    """The median time of each phase in logging steps (49, 99, ...) and quiet steps (ms)."""
    found, times = overhead.discovered(), []  # type: list[list[float]]
    marks = [_Marks(True, times), *(found[n]() for n in names), _Marks(False, times)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        overhead.fit(model, marks, steps)
    # a phase ends where the next starts; a step's last phase ends at the next step's start
    spans = [
        [b - a for a, b in zip(t, [*t[1:], n[0]], strict=True)]
        for t, n in itertools.pairwise(times)
    ]
    logging_steps = [spans[i] for i in range(49, len(spans), 50)]
    quiet = [s for i, s in enumerate(spans) if i > 3 and i % 50 not in (0, 48, 49)]
    print(f"| phase ({', '.join(names)}) | logging step | quiet step | extra |")
    print("| --- | --- | --- | --- |")
    for i, phase in enumerate((*_MARKS[:-1], "batch end, next batch")):
        a = statistics.median(s[i] for s in logging_steps) * 1e3
        b = statistics.median(s[i] for s in quiet) * 1e3
        print(f"| {phase} | {a:.2f} ms | {b:.2f} ms | {a - b:+.2f} ms |")
    a = statistics.median(sum(s) for s in logging_steps) * 1e3
    b = statistics.median(sum(s) for s in quiet) * 1e3
    print(f"| step | {a:.2f} ms | {b:.2f} ms | {a / b:.2f}x |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--only", nargs="*", default=None, help="callback class names")
    parser.add_argument("--model", default="launch", choices=list(overhead.MODELS))
    parser.add_argument(
        "--phases", type=int, default=0, metavar="STEPS", help="time phases over a fit instead"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    found = overhead.discovered()
    names = args.only or list(found)
    if args.phases:
        phases(names, args.model, args.phases)
        return
    probe = _Profiled(args.skip, args.steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        overhead.fit(
            args.model,
            [probe, *(found[n]() for n in names)],
            args.skip + args.steps + 2,
            log_every_n_steps=1,
        )
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        stats = pstats.Stats(probe.profile, stream=out)
        stats.sort_stats(key).print_stats(args.top)
        print(f"## by {key}, {', '.join(names)}: {args.steps} logging steps\n")
        print(out.getvalue().split("\n", 6)[-1])


if __name__ == "__main__":
    main()
