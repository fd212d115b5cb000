"""What ``GradFlowCallback`` costs when every step is sampled, with its parts switched off.

Every step a logging step (``every_n_steps=1``): the statistics, the alarms (their every-step
sentinel and the ``stall`` rule's typical update at each logging step) and the instability
statistics (the attention capture and the output logits' log-partition) run each step. Process
CPU time per step against bare training, median over interleaved rounds, one torch thread
(``overhead.py``'s harness and models)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/sampled_step_parts.py --models mlp transformer

``--all`` times every callback at ``every_n_steps=1`` instead, with and without the gated hooks
run outside the attention capture's ``TorchFunctionMode`` (:func:`outside_shelved`; without it,
as before session 11, each torch call of another statistic's hook inside a sampled forward goes
through the mode's Python)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/sampled_step_parts.py --all --models launch mlp
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

import pytorch_lightning as pl
import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]

import overhead  # noqa: E402
from overhead import Config  # noqa: E402

from lightning_hooks import GradFlowCallback  # noqa: E402
from lightning_hooks.core.hooks import registry  # noqa: E402
from lightning_hooks.core.hooks.registry import outside_shelved  # noqa: E402

PARTS = {
    "GradFlowCallback, every step": {},
    "the same, stability off": {"stability": False},
    "the same, alarms off": {"alarms": False},
    "the same, both off": {"alarms": False, "stability": False},
}


def _config(name: str, options: dict[str, bool]) -> Config:
    return Config(name, lambda: [GradFlowCallback(every_n_steps=1, **options)])  # type: ignore[arg-type]


class InsideTheMode(pl.Callback):
    """For its fit, the gated hooks run inside the attention capture's mode (before session
    11): the registry's ``outside_shelved`` is a plain call until the fit ends."""

    def setup(self, *args: object, **kwargs: object) -> None:
        registry.outside_shelved = lambda fn, *a: fn(*a)  # type: ignore[assignment]

    def teardown(self, *args: object, **kwargs: object) -> None:
        registry.outside_shelved = outside_shelved


def _every(inside: bool) -> list[pl.Callback]:
    found = overhead.discovered()
    every = [c(**overhead._accepted(c, {"every_n_steps": 1})) for c in found.values()]
    return [*every, *([InsideTheMode()] if inside else [])]


ALL = {
    "every callback, every step": lambda: _every(False),
    "the same, hooks inside the attention mode (before)": lambda: _every(True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--all", action="store_true", help="every callback, the mode A/B")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    configs = [Config("bare", list), *(_config(n, o) for n, o in PARTS.items())]
    if args.all:
        configs = [Config("bare", list), *(Config(n, f) for n, f in ALL.items())]
    print("| model | configuration | vs bare | step |\n| --- | --- | --- | --- |")
    for model in args.models:
        rows = overhead.time_rounds(model, configs, args.rounds, 50, 3)
        for name, row in rows.items():
            cpu = row["cpu"]
            print(f"| {model} | {name} | {cpu['ratio_median']:.3f}x | {cpu['step_ms']:.1f} ms |")


if __name__ == "__main__":
    main()
