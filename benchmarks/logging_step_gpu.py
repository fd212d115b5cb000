"""Where a logging step's time goes on a GPU: each callback alone, then all of them under
``torch.profiler``, on one of ``overhead.py``'s models (``--model resnet50 --precision
bf16-mixed`` on a lent GPU).

For each configuration, one ``Trainer.fit`` of 52 steps; the wall time of step 49 (the logging
step at ``log_every_n_steps=50``) and the median of steps 40-48 (quiet), each step timed between
two ``on_train_batch_start`` with the device synchronized. Then the profiler's top operators of
the logging step with every callback, by device and by host time::

    PYTHONPATH=$PWD python3 benchmarks/logging_step_gpu.py --model resnet50 --precision bf16-mixed
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]

import overhead  # noqa: E402

LOGGING_STEP = 49


class StepClock(pl.Callback):
    """Wall time of each step, the device synchronized at each step start; profiles the
    logging step when ``profile``."""

    def __init__(self, profile: bool = False) -> None:
        self.starts: dict[int, float] = {}
        self.profile = profile
        self.prof: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        step = trainer.global_step
        self.starts[step] = time.perf_counter()
        if self.profile and step == LOGGING_STEP:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts)
            self.prof.__enter__()
        if self.prof is not None and step == LOGGING_STEP + 1:
            self.prof.__exit__(None, None, None)

    def ms(self, step: int) -> float:
        return (self.starts[step + 1] - self.starts[step]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--top", type=int, default=25, help="0: no profile")
    parser.add_argument("--only", nargs="*", default=[], help="configurations to time (all)")
    args = parser.parse_args()
    overhead.ACCELERATOR = "cuda" if torch.cuda.is_available() else "cpu"
    overhead.PRECISION = args.precision
    found = overhead.discovered()
    overhead.fit(args.model, [], 5)  # warm-up
    configs = {"bare": [], **{n: [c] for n, c in found.items()}, "all": list(found.values())}
    for name, classes in configs.items():
        if args.only and name not in args.only:
            continue
        clock = StepClock()
        overhead.fit(args.model, [clock, *(c() for c in classes)], LOGGING_STEP + 3)
        quiet = statistics.median(clock.ms(s) for s in range(40, LOGGING_STEP))
        print(
            f"{name:28s} quiet {quiet:8.2f} ms  logging step {clock.ms(LOGGING_STEP):8.2f} ms",
            flush=True,
        )
    if args.top <= 0:
        return
    clock = StepClock(profile=True)
    overhead.fit(args.model, [clock, *(c() for c in found.values())], LOGGING_STEP + 3)
    table = clock.prof.key_averages()
    for key in ("self_cuda_time_total", "self_cpu_time_total"):
        if key == "self_cuda_time_total" and not torch.cuda.is_available():
            continue
        print(table.table(sort_by=key, row_limit=args.top, max_name_column_width=48))


if __name__ == "__main__":
    main()
