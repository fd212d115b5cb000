"""Per-output cost of the activation statistics: eager :func:`feature_stats` against the compiled
:func:`fused_feature_stats`, and of :func:`fired_counts`, on the benchmark CNN's output shapes.

Each call starts as a forward hook sees an output: a 64 MiB buffer is written (the rest of the
step), then the output itself (just produced, so what of it fits is in cache). Calls are timed
in process CPU time and the rounds interleave the variants; the median per call is printed, in
ms. ``feature_stats, whole`` is the eager statistics with :data:`CHUNK` set above the output's
size: every pass over the whole tensor. ``compiled`` calls the compiled statistics directly,
without ``fused_feature_stats``'s check for strided tensors.

Last, the batch a logging step of the launch-bound stand-in measures at its end: 73 outputs of
``[16, 64]`` in one :func:`stacked_feature_stats`, counting by sums of signs (the CPU's way,
:data:`SIGN_COUNTS`) and by comparisons (the way off the CPU).

Usage::

    PYTHONPATH=$PWD python benchmarks/feature_stats.py --threads 1 --calls 100 --rounds 5
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from lightning_hooks.core.ops.feature_stats import (
    feature_stats,
    fused_feature_stats,
    stacked_feature_stats,
)
from lightning_hooks.core.ops.tensors import Workspace
from lightning_hooks.core.stats.dead_units import fired_counts

fs = importlib.import_module(
    "lightning_hooks.core.ops.feature_stats"
)  # the module, not the function

SHAPES = ((64, 32, 32, 32), (64, 64, 16, 16), (64, 128, 8, 8), (32, 64, 128), (64, 1024))


def _time(fn: Callable[[], object], calls: int, evict: torch.Tensor, x: torch.Tensor) -> float:
    times = []
    for _ in range(calls):
        evict.add_(1.0)
        x.mul_(1.0)
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3


def _whole(x: torch.Tensor, ws: Workspace) -> torch.Tensor:
    pieces = getattr(fs, "CHUNK")  # noqa: B009 (mypy: a module found at run time)
    setattr(fs, "CHUNK", x.numel())  # noqa: B010
    try:
        return feature_stats(x, ws)
    finally:
        setattr(fs, "CHUNK", pieces)  # noqa: B010


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    evict = torch.empty(16 << 20)
    ws = Workspace()
    for shape in SHAPES:
        x = torch.randn(shape).relu()
        fused_feature_stats(x)  # compile outside the timing
        variants: dict[str, Callable[[], object]] = {
            "feature_stats": partial(feature_stats, x, ws),
            "feature_stats, whole": partial(_whole, x, ws),
            "fused_feature_stats": partial(fused_feature_stats, x),
            "compiled": partial(fs._compiled(), x),
            "fired_counts": partial(fired_counts, x, 1, ws),
        }
        rows: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                rows[name].append(_time(fn, args.calls, evict, x))
        cells = "  ".join(f"{n} {statistics.median(v):.3f}" for n, v in rows.items())
        print(f"{list(shape)!s:18s} {cells}")
    _stacked(args.calls, args.rounds, evict)


def _stacked(calls: int, rounds: int, evict: torch.Tensor) -> None:
    """The logging step's batch of 73 ``[16, 64]`` outputs, both ways of counting."""
    x = torch.randn(73, 16, 64)
    signs = getattr(fs, "SIGN_COUNTS")  # noqa: B009 (mypy: a module found at run time)
    rows: dict[str, list[float]] = {"sums of signs": [], "comparisons": []}
    for _ in range(rounds):
        for name, times in rows.items():
            setattr(fs, "SIGN_COUNTS", signs if name == "sums of signs" else frozenset())  # noqa: B010
            try:
                times.append(_time(partial(stacked_feature_stats, x), calls, evict, x))
            finally:
                setattr(fs, "SIGN_COUNTS", signs)  # noqa: B010
    cells = "  ".join(f"{n} {statistics.median(v):.3f}" for n, v in rows.items())
    print(f"{'stacked [73, 16, 64]':18s} {cells}")


if __name__ == "__main__":
    main()
