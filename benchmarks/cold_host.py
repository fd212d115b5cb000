"""What the sentinel's host arithmetic costs right after a training step, against the same call
repeated at once (issue 36, session 16).

On a quiet step the rules run in numpy on the host (``HostSegments.fold``, then
``GradientRules.read``): a few dozen calls over vectors of a hundred floats, about 25 us when
timed in a loop. In a fit they run right after the step's backward and optimizer step, whose
work has pushed numpy's code and data out of the caches. This times, in a plain torch loop on
the launch-bound stand-in (no Lightning), one ``np.multiply``, the fold and the rules' read,
each first after a step (cold) and then again at once (warm). Medians over the steps::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/cold_host.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]

import overhead  # noqa: E402

from lightning_hooks.core.alarms import AlarmRules, HostSegments  # noqa: E402
from lightning_hooks.core.alarms.gradients import GradientRules  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = overhead._launch()
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    params = list(net.parameters())
    owner = [i // 2 for i in range(len(params))]  # weight and bias of each layer: one row
    layers = owner[-1] + 1
    fold = HostSegments(owner, layers, range(len(params)))
    rules = GradientRules(layers + 1, AlarmRules())
    a, out = np.random.rand(len(params)).astype(np.float32), np.zeros(len(params))
    times: dict[str, list[float]] = {}

    def timed(name: str, call: object) -> None:
        for when in ("cold", "warm"):
            started = time.perf_counter()
            call()  # type: ignore[operator]
            times.setdefault(f"{name}, {when}", []).append(time.perf_counter() - started)

    for _ in range(args.steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
        norms = torch.stack(torch._foreach_norm([p.grad for p in params])).numpy()
        timed("np.multiply", lambda: np.multiply(a, a, out=out, dtype=np.float64))
        timed("HostSegments.fold", lambda n=norms: fold.fold(n))
        rows = fold.fold(norms).copy()
        timed("GradientRules.read", lambda r=rows: rules.read(r, None, False, None))
    print(f"torch {torch.__version__}, {args.steps} steps of the launch-bound stand-in")
    print("| call | after a step (cold) | repeated at once (warm) |")
    print("| --- | --- | --- |")
    for name in ("np.multiply", "HostSegments.fold", "GradientRules.read"):
        cold, warm = (statistics.median(times[f"{name}, {w}"][20:]) * 1e6 for w in ("cold", "warm"))
        print(f"| {name} | {cold:.1f} us | {warm:.1f} us |")


if __name__ == "__main__":
    main()
