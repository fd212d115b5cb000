"""What a sampled step adds in hooks and in ATen ops: how many module hooks each callback's
registry installs for it, what installing and removing them costs (the gated hooks:
``core/hooks/registry.py``), and the ATen ops it dispatches beyond a bare step.

On the launch-bound stand-in (``overhead._launch``), with ``GradFlowCallback()`` alone and with
all five callbacks at their defaults: per registry, the gated hooks and the time of one
install-and-remove (median of 50), read at step 3 of a short fit; then, in fits that sample
every step, step 5's ATen ops less a bare fit's step 5 (a count: no noise)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/gated_hooks.py
"""

from __future__ import annotations

import inspect
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]

import overhead  # noqa: E402
from ops import OpCounter  # noqa: E402

import lightning_hooks  # noqa: E402
from lightning_hooks.core.hooks.registry import HookRegistry  # noqa: E402


class _Gates(pl.Callback):
    """At step 3: each registry's gated hooks, and one install-and-remove of them, timed."""

    def __init__(self, registries: list[HookRegistry]) -> None:
        self.registries = registries
        self.rows: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != 3:
            return
        for registry in self.registries:
            if not registry._gated_hooks or registry.fixed:
                continue
            times = []
            for _ in range(50):
                started = time.perf_counter()
                registry.sampled = True
                registry.sampled = False
                times.append(time.perf_counter() - started)
            self.rows.append((len(registry._gated_hooks), statistics.median(times) * 1e6))


class _Ops(pl.Callback):
    """The ATen ops dispatched from step 5's start to step 6's."""

    def __init__(self) -> None:
        self.counter = OpCounter()
        self.total = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 5:
            self.counter.start()
        elif trainer.global_step == 6:
            self.counter.stop()
            self.total = self.counter.total


def _sampled_ops(callbacks: list[pl.Callback]) -> int:
    ops = _Ops()
    overhead.fit("launch", [ops, *callbacks], 8)
    return ops.total


def _every_step(cls: type[pl.Callback]) -> pl.Callback:
    takes = "every_n_steps" in inspect.signature(cls).parameters
    return cls(every_n_steps=1) if takes else cls()


def main() -> None:
    torch.set_num_threads(1)
    registries: list[HookRegistry] = []
    init = HookRegistry.__init__

    def tracked(self: HookRegistry, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        registries.append(self)

    HookRegistry.__init__ = tracked  # type: ignore[method-assign]
    found = overhead.discovered()
    configs = {
        "GradFlowCallback()": [lightning_hooks.GradFlowCallback],
        "all five at their defaults": list(found.values()),
    }
    bare = _sampled_ops([])
    print(f"lightning_hooks from {Path(lightning_hooks.__file__).parent}")
    print("| configuration | gated hooks per registry | install + remove | ATen ops beyond bare |")
    print("| --- | --- | --- | --- |")
    for name, classes in configs.items():
        registries.clear()
        gates = _Gates(registries)
        overhead.fit("launch", [*(cls() for cls in classes), gates], 5)
        hooks = " + ".join(str(n) for n, _ in gates.rows)
        total = sum(us for _, us in gates.rows)
        extra = _sampled_ops([_every_step(cls) for cls in classes]) - bare
        print(f"| {name} | {hooks} = {sum(n for n, _ in gates.rows)} | {total:.0f} us | {extra} |")


if __name__ == "__main__":
    main()
