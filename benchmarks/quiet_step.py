"""What a quiet step costs in our own hooks, against the floor's hook in the same steps.

Where the host is shared, step times between fits swing by 2x (``overhead.py``'s rounds on the
launch-bound stand-in ranged 0.5x-3.5x on a shared 2-core host), and no ratio of two fits can
be tabled.
This measures inside one fit instead: a timing wrapper around every Lightning hook of our
callbacks (``perf_counter`` around the call: the hook's own time, whatever Lightning does
around it), and around the floor's hook, ``torch._foreach_norm`` over the gradients
(``overhead.GradientRead``), which runs in the same steps. Both see the same slow and fast
moments of the host, so their ratio holds where the step time does not. Not counted: Lightning's
dispatch of our hooks, and the gated module hooks of logging steps (a quiet step has none).

Per configuration, the medians over the quiet steps (not a logging step) of a 400-step fit on
the launch-bound stand-in (``overhead._launch``), one torch thread::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quiet_step.py
    PYTHONPATH=/path/to/another/checkout .venv/bin/python benchmarks/quiet_step.py  # compare

On a lent GPU (``--accelerator cuda``) the times are the host's: what our hooks and the floor's
hook take to launch their kernels and run their Python, the step's wall time beside them::

    PYTHONPATH=$PWD python3 benchmarks/quiet_step.py --accelerator cuda --model launch
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]

import overhead  # noqa: E402

import lightning_hooks  # noqa: E402

_HOOKS = [name for name in dir(pl.Callback) if name.startswith("on_")]


class _Clock(pl.Callback):
    """Each step's start, and which steps were logging steps."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append(time.perf_counter())


def _timed(callback: pl.Callback, into: dict[int, float], clock: _Clock) -> pl.Callback:
    """``callback`` with each Lightning hook's own time added to ``into[step]``."""
    for name in _HOOKS:
        hook = getattr(callback, name)

        def wrapped(*args: Any, _hook: Callable[..., Any] = hook, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return _hook(*args, **kwargs)
            finally:
                into[len(clock.starts)] += time.perf_counter() - started

        setattr(callback, name, wrapped)
    return callback


def measure(
    make: Callable[[], list[pl.Callback]], steps: int, model: str = "launch"
) -> dict[str, float]:
    """Medians over the quiet steps of one fit: the step, our hooks, the floor's hook (us)."""
    clock = _Clock()
    ours: dict[int, float] = defaultdict(float)
    floor: dict[int, float] = defaultdict(float)
    callbacks = [_timed(c, ours, clock) for c in make()]
    overhead.fit(model, [clock, _timed(overhead.GradientRead(), floor, clock), *callbacks], steps)
    every = 50  # the Trainer's log_every_n_steps: steps 0, 49, 99, ... are logging steps
    quiet = [i for i in range(3, steps - 1) if i % every not in (0, every - 1, every - 2)]
    step = [clock.starts[i] - clock.starts[i - 1] for i in quiet]
    return {
        "step_us": statistics.median(step) * 1e6,
        "ours_us": statistics.median(ours[i] for i in quiet) * 1e6,
        "floor_us": statistics.median(floor[i] for i in quiet) * 1e6,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="launch", choices=[*overhead.MODELS, *overhead.LARGE])
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="32-true", help="e.g. bf16-mixed")
    args = parser.parse_args(argv)
    overhead.ACCELERATOR, overhead.PRECISION = args.accelerator, args.precision
    if args.accelerator == "cpu":
        torch.set_num_threads(1)
    found = overhead.discovered()
    configs = {
        "GradFlowCallback()": lambda: [lightning_hooks.GradFlowCallback()],
        "all five at their defaults": lambda: [cls() for cls in found.values()],
    }
    reads = ["triton"] if args.accelerator == "cuda" else []  # Triton runs on CUDA only
    for read in reads:  # the other read of a quiet step's norms, beside the default (grouped)
        rules = lightning_hooks.AlarmRules(quiet_read=read)
        configs[f"GradFlowCallback(alarms=AlarmRules(quiet_read={read!r}))"] = partial(
            lambda r: [lightning_hooks.GradFlowCallback(alarms=r)], rules
        )
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name, make in configs.items():
            rows[name].append(measure(make, args.steps, args.model))
    print(f"lightning_hooks from {Path(lightning_hooks.__file__).parent}")
    print(f"model {args.model}, {args.accelerator}, {args.precision}, torch {torch.__version__}")
    print("| configuration | step | our hooks | floor's hook | ours / floor | ours / step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, runs in rows.items():
        ratio = statistics.median(r["ours_us"] / r["floor_us"] for r in runs)
        share = statistics.median(r["ours_us"] / r["step_us"] for r in runs)
        step = statistics.median(r["step_us"] for r in runs) / 1e3
        ours = statistics.median(r["ours_us"] for r in runs)
        floor = statistics.median(r["floor_us"] for r in runs)
        print(
            f"| {name} | {step:.2f} ms | {ours:.0f} us | {floor:.0f} us | {ratio:.2f}x "
            f"| {share:.1%} |"
        )


if __name__ == "__main__":
    main()
