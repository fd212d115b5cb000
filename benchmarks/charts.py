"""What the epoch's gradient-flow chart costs to build and render (``grad_flow_figure``, drawn
with matplotlib's Agg canvas as TensorBoard's ``add_figure`` does), for 10, 75 and 200 layers:
the minimum of 5 renders each. It runs at every epoch's end on rank 0, in the training
process::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/charts.py
    PYTHONPATH=/path/to/another/checkout .venv/bin/python benchmarks/charts.py  # compare
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg

import lightning_hooks
from lightning_hooks.logging.figures import grad_flow_figure


def render_ms(layers: int, repeats: int = 5) -> float:
    """The fastest of ``repeats`` builds and renders of a ``layers``-layer chart (ms)."""
    rng = np.random.default_rng(0)
    names = [f"net.{i}" for i in range(layers)]
    mean, peak = rng.random(layers) * 1e-3, rng.random(layers) * 1e-2
    mean[layers // 3] = 0.0  # a zero and a non-finite layer: the red marks are drawn too
    peak[layers // 2] = np.nan
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        FigureCanvasAgg(grad_flow_figure(names, mean, peak)).draw()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def main() -> None:
    print(f"lightning_hooks from {Path(lightning_hooks.__file__).parent}")
    print("| layers | build + render |")
    print("| --- | --- |")
    for layers in (10, 75, 200):
        print(f"| {layers} | {render_ms(layers):.0f} ms |")


if __name__ == "__main__":
    main()
