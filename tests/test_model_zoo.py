"""The zoo (tests/zoo.py) through Trainer.fit with every callback at once, every step measured:
the logged gradient flow and activation means equal each model's own plain-torch record, and
no hook is left after fit."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
from torch import nn
from zoo import ZOO, FinetuneZoo, ZooModule

from lightning_hooks import (
    ActivationStatsCallback,
    DeadReLUCallback,
    FeatureMapCallback,
    GradFlowCallback,
    LayerTimeCallback,
    SaturationCallback,
)
from lightning_hooks.core import SATURATING_TYPES

from conftest import hooks_left, make_trainer, read_scalars

_RELUS = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU)


def _callbacks(model: ZooModule) -> list[pl.Callback]:
    callbacks: list[pl.Callback] = [
        GradFlowCallback(every_n_steps=1),
        ActivationStatsCallback(every_n_steps=1),
        LayerTimeCallback(every_n_steps=1),
        FeatureMapCallback(input_fn=model.probe_input),
    ]
    kinds = {type(m) for m in model.modules()}
    if any(issubclass(k, _RELUS) for k in kinds):
        callbacks.append(DeadReLUCallback(every_n_steps=1))
    if any(issubclass(k, SATURATING_TYPES) for k in kinds):
        callbacks.append(SaturationCallback(every_n_steps=1))
    if isinstance(model, FinetuneZoo):
        callbacks.append(model.finetuning())
    return callbacks


def _by_epoch(scalars: dict[str, list[tuple[int, float]]], tag: str, ends: list[int]) -> dict:
    return {ends.index(step): value for step, value in scalars.get(tag, [])}


def _reference(model: ZooModule, key: str, layer: str | None) -> dict[int, float]:
    """Per epoch, the mean over the steps that have ``layer`` (``None``: the global value)."""
    per_epoch: dict[int, list[float]] = {}
    for step in model.steps:
        value = step[key] if layer is None else step[key].get(layer)
        if value is not None and not math.isnan(value):
            per_epoch.setdefault(step["epoch"], []).append(value)
    return {epoch: float(np.mean(values)) for epoch, values in per_epoch.items()}


def _check(logged: dict[int, float], want: dict[int, float], what: str) -> None:
    assert logged.keys() == want.keys(), (what, logged, want)
    for epoch, value in want.items():
        assert math.isclose(logged[epoch], value, rel_tol=2e-4, abs_tol=1e-7), (
            what,
            epoch,
            logged[epoch],
            value,
        )


# DeadReLU's warning is its finding (the GAN's LeakyReLU units never positive), not a failure.
@pytest.mark.filterwarnings("ignore:.*units dead.*:lightning_hooks.errors.LightningHooksWarning")
@pytest.mark.parametrize("zoo_cls", ZOO, ids=lambda c: c.__name__)
def test_zoo_every_callback_matches_plain_torch(zoo_cls: type[ZooModule], tmp_path: Path) -> None:
    # The initialisation (a dead-unit warning depends on it), whatever ran before.
    pl.seed_everything(0, verbose=False)
    model = zoo_cls()
    trainer = make_trainer(tmp_path, callbacks=_callbacks(model), max_epochs=2)
    trainer.fit(model)
    scalars = read_scalars(tmp_path)
    ends = sorted(step for step, _ in scalars["grad_flow/global/grad_norm"])
    assert len(ends) == 2
    _check(
        _by_epoch(scalars, "grad_flow/global/grad_norm", ends),
        _reference(model, "global", None),
        "global grad_norm",
    )
    layers = {name for step in model.steps for name in step["grad"]}
    logged = {t.split("/", 2)[2] for t in scalars if t.startswith("grad_flow/grad_norm/")}
    assert logged == layers
    for layer in layers:
        tag = f"grad_flow/grad_norm/{layer}"
        _check(_by_epoch(scalars, tag, ends), _reference(model, "grad", layer), tag)
    for layer in {name for step in model.steps for name in step["out"]}:
        tag = f"grad_flow/output_grad_norm/{layer}"
        _check(_by_epoch(scalars, tag, ends), _reference(model, "out", layer), tag)
    for (epoch, layer), (total, count) in model.acts.items():
        ((_, value),) = [
            (s, v) for s, v in scalars[f"activations/mean/{layer}"] if s == ends[epoch]
        ]
        assert math.isclose(value, total / count, rel_tol=1e-4, abs_tol=1e-6), (layer, epoch)
    for prefix in ("layer_time/", "feature_map/abs_mean/"):
        assert any(tag.startswith(prefix) for tag in scalars), prefix
    assert hooks_left(model) == []
    assert all(not opt._optimizer_step_post_hooks for opt in trainer.optimizers)
