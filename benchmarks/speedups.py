"""What each of the library's speed-ups over a private attribute buys, on the launch-bound
stand-in with every callback at its defaults (``log_every_n_steps=50``), one torch thread.

Each speed-up has a public twin; one that buys under 1% of the stand-in's bare step at the
defaults goes away (``lightning_hooks/internals.py`` says which stay and what each buys):

- **gated hooks by hand**: the hooks of a logging step put on and taken off the modules' hook
  dicts under ids reserved once, against ``register_forward_hook`` and ``handle.remove()``;
- **Lightning's empty hooks shadowed**: the inherited per-batch hooks of each callback set to
  ``None`` on the instance, so that Lightning skips them, against Lightning calling them;
- **one TensorBoard event per logging step**: the scalars of a logging step as one ``Summary``
  built from protobuf's wire bytes through the writer's file writer, against the logger's own
  ``log_metrics`` (one ``add_scalar`` each);
- **TensorBoard's checksums in C**: see ``benchmarks/tensorboard_crc.py``.

Usage::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/speedups.py
"""

from __future__ import annotations

import inspect
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger

sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead

from lightning_hooks.callbacks.trainer import PER_BATCH_HOOKS, skip_inherited

STEPS = 100
EVERY = 50
REPEATS = 7


def _best(fn: Callable[[], None], repeats: int = REPEATS) -> float:
    """The fastest of ``repeats`` calls of ``fn``, in seconds (the host's noise only adds)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


class _Probe(pl.Callback):
    """Last in the list: the forward (pre-)hooks on the model at a quiet and a logging step, and
    one logging step's scalars."""

    def __init__(self) -> None:
        self.hooks: dict[str, int] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        step = trainer.global_step
        if step in (EVERY - 2, EVERY - 1):
            kind = "logging" if step == EVERY - 1 else "quiet"
            self.hooks[kind] = sum(
                len(m._forward_hooks) + len(m._forward_pre_hooks) for m in pl_module.modules()
            )


def bare_step() -> float:
    """The stand-in's mean bare step in seconds, the best of three fits."""
    means = []
    for _ in range(3):
        timer = overhead.StepTimer()
        overhead.fit("launch", [timer], STEPS)
        means.append(statistics.mean(timer.steps(skip=5, clock="cpu")))
    return min(means)


def gated_hooks() -> tuple[int, dict[str, float]]:
    """How many hooks a logging step puts on, and one logging step's scalars."""
    probe = _Probe()
    capture = overhead.CaptureLogger()
    callbacks = [cls() for cls in overhead.discovered().values()]
    overhead.fit("launch", [*callbacks, probe], EVERY + 1, logger=capture)
    return probe.hooks["logging"] - probe.hooks["quiet"], capture.metrics


def gate_cost(hooks: int) -> dict[str, float]:
    """Seconds to put ``hooks`` forward hooks on the stand-in's modules and take them off."""
    modules = list(overhead.make_model("launch", 1).modules())
    placed = [modules[i % len(modules)] for i in range(hooks)]

    def hook(*args: object) -> None:
        return None

    def public() -> None:
        handles = [m.register_forward_hook(hook, always_call=True) for m in placed]
        for handle in handles:
            handle.remove()

    keys = list(range(10**9, 10**9 + hooks))

    def by_hand() -> None:
        for module, key in zip(placed, keys, strict=True):
            module._forward_hooks[key] = hook
            module._forward_hooks_always_called[key] = True
        for module, key in zip(placed, keys, strict=True):
            module._forward_hooks.pop(key, None)
            module._forward_hooks_always_called.pop(key, None)

    return {"public": _best(public), "by hand": _best(by_hand)}


def _dispatch(trainer: pl.Trainer, model: Any, callbacks: list[pl.Callback]) -> Callable[[], None]:
    """Lightning's dispatch of every per-batch hook of ``callbacks``, 100 times (as
    ``_call_callback_hooks``: ``getattr``, ``callable``, the profiler's context, the call)."""
    arguments = {}
    for name in PER_BATCH_HOOKS:
        count = len(inspect.signature(getattr(pl.Callback, name)).parameters) - 3
        arguments[name] = (trainer, model, *[None] * count)

    def dispatch() -> None:
        for _ in range(100):
            for name in PER_BATCH_HOOKS:
                for callback in callbacks:
                    fn = getattr(callback, name)
                    if callable(fn):
                        with trainer.profiler.profile(f"[Callback]{callback.state_key}.{name}"):
                            fn(*arguments[name])

    return dispatch


def dispatch_cost() -> dict[str, float]:
    """Seconds of Lightning's dispatch of the inherited per-batch hooks of every callback, one
    step, called and shadowed (the callbacks' own hooks need a running fit: they are left out)."""
    callbacks = [cls() for cls in overhead.discovered().values()]
    model = overhead.make_model("launch", 2)
    trainer = pl.Trainer(
        max_epochs=1, limit_train_batches=1, logger=False, enable_checkpointing=False
    )
    trainer.strategy.connect(model)
    own = {n for n in PER_BATCH_HOOKS for c in callbacks if n in type(c).__dict__}
    for callback in callbacks:
        callback.__dict__.update(dict.fromkeys(own))
    dispatch = _dispatch(trainer, model, callbacks)
    called = _best(dispatch) / 100
    for callback in callbacks:
        skip_inherited(callback, trainer)
    shadowed = _best(dispatch) / 100
    return {"called": called, "shadowed": shadowed}


def write_cost(metrics: dict[str, float]) -> dict[str, float]:
    """Seconds to write one logging step's scalars to TensorBoard, both ways, and flush."""
    from lightning_hooks.internals.tensorboard import scalar_summary

    with tempfile.TemporaryDirectory() as tmp:
        logger = TensorBoardLogger(tmp, name="tb")
        writer = logger.experiment

        def summary() -> None:
            writer._get_file_writer().add_summary(scalar_summary(metrics), 0)
            writer.flush()

        def log_metrics() -> None:
            logger.log_metrics(dict(metrics), step=0)
            writer.flush()

        return {"one Summary": _best(summary), "log_metrics": _best(log_metrics)}


def main() -> None:
    torch.set_num_threads(1)
    bare = bare_step()
    hooks, metrics = gated_hooks()
    print(f"stand-in bare step {bare * 1e3:.2f} ms; all six at their defaults, one logging step")
    print(
        f"in {EVERY}: {hooks} gated hooks; {len(metrics)} scalars in a logging step "
        "and an epoch end\n"
    )
    print("| speed-up | public twin | speed-up | saved per step at the defaults |")
    print("| --- | --- | --- | --- |")
    gate = gate_cost(hooks)
    saved = (gate["public"] - gate["by hand"]) / EVERY
    print(
        f"| gated hooks by hand | {gate['public'] * 1e6:.0f} us a logging step | "
        f"{gate['by hand'] * 1e6:.0f} us | {saved * 1e6:.1f} us = {saved / bare:.2%} |"
    )
    dispatch = dispatch_cost()
    saved = dispatch["called"] - dispatch["shadowed"]
    print(
        f"| empty hooks shadowed | {dispatch['called'] * 1e6:.0f} us a step | "
        f"{dispatch['shadowed'] * 1e6:.0f} us | {saved * 1e6:.1f} us = {saved / bare:.2%} |"
    )
    write = write_cost(metrics)
    saved = (write["log_metrics"] - write["one Summary"]) / EVERY
    print(
        f"| one TensorBoard event | {write['log_metrics'] * 1e3:.2f} ms a logging step | "
        f"{write['one Summary'] * 1e3:.2f} ms | {saved * 1e6:.1f} us = {saved / bare:.2%} |"
    )


if __name__ == "__main__":
    main()
