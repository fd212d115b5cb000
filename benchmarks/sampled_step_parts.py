"""What ``GradFlowCallback`` costs when every step is sampled, with its parts switched off.

Every step a logging step (``every_n_steps=1``): the statistics, the alarms (their every-step
sentinel and the ``stall`` rule's typical update at each logging step) and the instability
statistics (the attention capture and the output logits' log-partition) run each step. Process
CPU time per step against bare training, median over interleaved rounds, one torch thread
(``overhead.py``'s harness and models)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/sampled_step_parts.py --models mlp transformer
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]

import overhead  # noqa: E402
from overhead import Config  # noqa: E402

from lightning_hooks import GradFlowCallback  # noqa: E402

PARTS = {
    "GradFlowCallback, every step": {},
    "the same, stability off": {"stability": False},
    "the same, alarms off": {"alarms": False},
    "the same, both off": {"alarms": False, "stability": False},
}


def _config(name: str, options: dict[str, bool]) -> Config:
    return Config(name, lambda: [GradFlowCallback(every_n_steps=1, **options)])  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "transformer"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    configs = [Config("bare", list), *(_config(n, o) for n, o in PARTS.items())]
    print("| model | configuration | vs bare | step |\n| --- | --- | --- | --- |")
    for model in args.models:
        rows = overhead.time_rounds(model, configs, args.rounds, 50, 3)
        for name, row in rows.items():
            cpu = row["cpu"]
            print(f"| {model} | {name} | {cpu['ratio_median']:.3f}x | {cpu['step_ms']:.1f} ms |")


if __name__ == "__main__":
    main()
