"""The zoo's figures in ``docs/custom-stat.md``: what GradFlowCallback logs against the
plain-torch figure each zoo model records. Run from the repository root:

    PYTHONPATH=$PWD:$PWD/tests .venv/bin/python tests/zoo_numbers.py
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from zoo import FinetuneZoo, GANZoo, GPTZoo, RecommenderZoo, ZooModule

from conftest import make_trainer, read_scalars


class TiedOnly(GPTZoo):
    """GPTZoo without its temperature: the tie is then the only difference from torch."""

    def __init__(self) -> None:
        super().__init__()
        del self.temperature
        self.temperature = 1.0  # type: ignore[assignment]


def _fit(model: ZooModule, *extra: Any) -> dict[str, list[tuple[int, float]]] | str:
    from lightning_hooks import GradFlowCallback

    root = Path(tempfile.mkdtemp())
    callbacks = [GradFlowCallback(every_n_steps=1), *extra]
    try:
        make_trainer(root, callbacks=callbacks, max_epochs=2).fit(model)
    except Exception as err:  # main's crashes are part of the table
        return f"{type(err).__name__}: {str(err)[:60]}"
    return read_scalars(root)


def _reference(model: ZooModule, key: str, layer: str | None = None) -> float:
    values = [s[key] if layer is None else s[key].get(layer) for s in model.steps]
    pairs = zip(model.steps, values, strict=True)
    return float(np.mean([v for s, v in pairs if v and s["epoch"] == 0]))


def _first(scalars: dict[str, Any] | str, tag: str) -> str:
    if isinstance(scalars, str):
        return scalars
    return f"{scalars[tag][0][1]:.4f}" if tag in scalars else "not logged"


def main() -> None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model: ZooModule = TiedOnly()
    got = _fit(model)
    print(
        f"tied GPT, global grad_norm: logged {_first(got, 'grad_flow/global/grad_norm')}, "
        f"torch get_total_norm {_reference(model, 'global'):.4f}"
    )
    torch.manual_seed(0)
    model = GANZoo()
    got = _fit(model)
    for layer in ("disc.0", "disc.2"):
        print(
            f"GAN {layer} output_grad_norm: logged "
            f"{_first(got, f'grad_flow/output_grad_norm/{layer}')}, "
            f"own backward only {_reference(model, 'out', layer):.4f}"
        )
    torch.manual_seed(0)
    model = RecommenderZoo()
    got = _fit(model)
    print(
        f"sparse users grad_norm: logged {_first(got, 'grad_flow/grad_norm/users')}, "
        f"dense torch {_reference(model, 'grad', 'users'):.4f}"
    )
    torch.manual_seed(0)
    model = FinetuneZoo()
    got = _fit(model, FinetuneZoo.finetuning())
    steps = sum("backbone.0" in s["grad"] for s in model.steps)
    print(
        f"BackboneFinetuning: {steps} steps with backbone gradients; backbone.0 grad_norm "
        f"logged at epoch 1: {_first(got, 'grad_flow/grad_norm/backbone.0')}"
    )


if __name__ == "__main__":
    main()
