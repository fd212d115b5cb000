"""Awkward models: activation checkpointing, shared modules, unused and frozen layers, outputs that
are dicts or ``None``, and a model that changes between two fits."""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader

from lightning_hooks import (
    ActivationStatsCallback,
    GradFlowCallback,
    LayerTimeCallback,
    LightningHooksWarning,
)

from conftest import TinyMLP, dataset, hooks_left, make_trainer, read_scalars


class Recorded(pl.LightningModule):
    """Records with plain torch, per optimizer step, each layer's gradient norm (layers with a
    gradient only) and the norm of d loss / d output of the outputs passed through :meth:`out`."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[dict[str, float], dict[str, float]]] = []
        self._sq: dict[str, float] = defaultdict(float)

    def out(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.requires_grad:
            tensor.register_hook(lambda g: self._add(name, g))
        return tensor

    def _add(self, name: str, grad: torch.Tensor) -> None:
        self._sq[name] += float(grad.double().pow(2).sum())

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norms = {}
        for name, module in self.named_modules():
            grads = [
                p.grad.flatten() for p in module.parameters(recurse=False) if p.grad is not None
            ]
            if grads:
                norms[name] = float(torch.cat(grads).norm())
        self.steps.append((norms, {k: math.sqrt(v) for k, v in self._sq.items()}))
        self._sq.clear()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(), batch_size=8)


def _check_recorded(model: Recorded, scalars: dict[str, list[tuple[int, float]]]) -> set[str]:
    """Every logged per-layer grad_norm / output_grad_norm against the record; the layers seen."""
    seen: set[str] = set()
    for kind, tag in ((0, "grad_norm"), (1, "output_grad_norm")):
        names = {n for step in model.steps for n in step[kind]}
        logged = {t.split("/", 2)[2] for t in scalars if t.startswith(f"grad_flow/{tag}/")}
        assert logged == names, (tag, logged, names)
        for name in names:
            want = np.mean([s[kind][name] for s in model.steps if name in s[kind]])
            ((_, got),) = scalars[f"grad_flow/{tag}/{name}"]
            assert math.isclose(got, want, rel_tol=1e-5), (tag, name, got, want)
        seen |= names
    return seen


class SharedTwice(Recorded):
    """One Linear applied twice: its gradient sums both uses, its output gradient both calls."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.shared, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.out("inp", self.inp(x)).tanh()
        h = self.out("shared", self.shared(h)).tanh()
        h = self.out("shared", self.shared(h)).tanh()
        return nn.functional.mse_loss(self.out("head", self.head(h)), y)


class DictEncoder(nn.Module):
    """Owns its weight; returns a dict with a tensor, a ``None`` and an int."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"h": x @ self.weight.T, "skip": None, "n": 3}


class SideEffect(nn.Module):
    """Owns a parameter, returns ``None``: the result is left on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.last: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> None:
        self.last = x * self.scale


class Awkward(Recorded):
    """A dict-returning encoder, a None-returning module, a frozen layer, a branch used on even
    batches only (its gradient is None on odd steps), and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = DictEncoder()
        self.side = SideEffect()
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.branch = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.out("encoder", self.encoder(x)["h"]).tanh()
        self.side(h)
        assert self.side.last is not None
        h = self.frozen(self.side.last)
        if batch_idx % 2 == 0:
            h = self.out("branch", self.branch(h)).relu()
        return nn.functional.mse_loss(self.out("head", self.head(h)), y)


@pytest.mark.parametrize("model_cls", [SharedTwice, Awkward])
def test_awkward_models_match_plain_torch(
    model_cls: type[Recorded], trainer_factory: Any, tmp_path: Path
) -> None:
    model = model_cls()
    trainer_factory(callbacks=[GradFlowCallback()]).fit(model)
    scalars = read_scalars(tmp_path)
    seen = _check_recorded(model, scalars)
    assert "frozen" not in seen and not [t for t in scalars if t.endswith("/frozen")]
    if model_cls is Awkward:
        # grad None on two of four steps: the mean is over the two steps with a gradient
        assert sum("branch" in norms for norms, _ in model.steps) == 2
        assert "grad_flow/grad_norm/side" in scalars  # no output, still a gradient
        assert "grad_flow/output_grad_norm/side" not in scalars
    assert hooks_left(model) == []


class CheckpointedMLP(TinyMLP):
    """TinyMLP whose middle block (net.2, net.3) runs under activation checkpointing."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[1](self.net[0](x))
        h = checkpoint(self.net[2:4], h, use_reentrant=self.use_reentrant)
        return self.net[4](h)  # type: ignore[no-any-return]


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_counts_each_output_gradient_once(
    use_reentrant: bool, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    make_trainer(tmp_path / "plain", callbacks=[GradFlowCallback()]).fit(TinyMLP())
    torch.manual_seed(0)
    model = CheckpointedMLP(use_reentrant)
    make_trainer(tmp_path / "ckpt", callbacks=[GradFlowCallback()]).fit(model)
    plain, ckpt = read_scalars(tmp_path / "plain"), read_scalars(tmp_path / "ckpt")
    tags = {t for t in plain if t.startswith("grad_flow/")}
    assert "grad_flow/output_grad_norm/net.2" in tags
    assert {t for t in ckpt if t.startswith("grad_flow/")} == tags
    for tag in tags:
        assert math.isclose(ckpt[tag][0][1], plain[tag][0][1], rel_tol=1e-6), tag
    assert hooks_left(model) == []


def test_a_layer_added_between_two_fits_is_tracked(tmp_path: Path) -> None:
    model, callback = TinyMLP(), GradFlowCallback()
    make_trainer(tmp_path / "first", callbacks=[callback]).fit(model)
    model.net.append(nn.Linear(1, 1))
    with pytest.warns(LightningHooksWarning, match=r"saved layers .*differ.*start afresh"):
        make_trainer(tmp_path / "second", callbacks=[callback]).fit(model)
    first, second = read_scalars(tmp_path / "first"), read_scalars(tmp_path / "second")
    assert "grad_flow/grad_norm/net.5" not in first
    for stat in ("grad_norm", "update_ratio", "output_grad_norm"):
        ((_, value),) = second[f"grad_flow/{stat}/net.5"]
        assert math.isfinite(value) and value > 0
    assert hooks_left(model) == []


class Scripted(Recorded):
    """A torch.jit.script submodule between two plain layers: it runs no Python hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        with warnings.catch_warnings():  # torch 2.10+ deprecates torch.jit.script
            warnings.simplefilter("ignore", DeprecationWarning)
            self.body = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.Tanh()))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.inp(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)


@pytest.mark.parametrize(
    "callback_cls", [GradFlowCallback, ActivationStatsCallback, LayerTimeCallback]
)
def test_a_scripted_submodule_is_skipped_with_one_warning(
    callback_cls: type[pl.Callback], tmp_path: Path
) -> None:
    model = Scripted()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, callbacks=[callback_cls(every_n_steps=1)]).fit(model)
    ours = [str(w.message) for w in caught if issubclass(w.category, LightningHooksWarning)]
    assert len(ours) == 1, ours
    assert ours[0].startswith(callback_cls.__name__) and "scripted" in ours[0]
    assert "body.0" in ours[0]
    scalars = read_scalars(tmp_path)
    assert model.trainer.global_step == 4
    if callback_cls is GradFlowCallback:
        # Its parameters are still measured (no module hook needed); the global norm has them.
        ((_, value),) = scalars["grad_flow/grad_norm/body.0"]
        want = np.mean([norms["body.0"] for norms, _ in model.steps])
        assert math.isclose(value, want, rel_tol=1e-5)
        assert "grad_flow/output_grad_norm/body.0" not in scalars
    parameter_stats = ("grad_flow/grad", "grad_flow/weight", "grad_flow/update")
    hooked = [t for t in scalars if "/body." in t and not t.startswith(parameter_stats)]
    assert hooked == []
    assert hooks_left(model) == []


class OnlyOwnParameters(pl.LightningModule):
    """Every parameter on the LightningModule itself: a scale, a shift and a temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8, 1) * 0.1)
        self.shift = nn.Parameter(torch.zeros(1))
        self.temperature = nn.Parameter(torch.ones(()))
        self.norms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss((x @ self.scale + self.shift) / self.temperature, y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(), batch_size=8)


def test_parameters_of_the_module_itself_get_a_row(tmp_path: Path) -> None:
    model = OnlyOwnParameters()
    make_trainer(tmp_path, callbacks=[GradFlowCallback(every_n_steps=1)]).fit(model)
    scalars = read_scalars(tmp_path)
    for tag in ("grad_flow/grad_norm/<root>", "grad_flow/global/grad_norm"):
        ((_, value),) = scalars[tag]
        assert math.isclose(value, float(np.mean(model.norms)), rel_tol=1e-5), tag
    assert hooks_left(model) == []


class LateLayer(Recorded):
    """``late`` is frozen and outside the optimizer until a callback unfreezes it mid-epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.late, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.late.requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        h = self.out("late", self.late(self.inp(x).tanh()))
        return nn.functional.mse_loss(self.head(h), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


class UnfreezeAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_step == self.step:
            pl_module.late.requires_grad_(True)
            trainer.optimizers[0].add_param_group({"params": list(pl_module.late.parameters())})


def test_a_layer_unfrozen_mid_epoch_is_measured_from_that_step(tmp_path: Path) -> None:
    model = LateLayer()
    callbacks = [UnfreezeAt(2), GradFlowCallback(every_n_steps=1)]
    make_trainer(tmp_path, callbacks=callbacks).fit(model)
    assert [("late" in norms) for norms, _ in model.steps] == [False, False, True, True]
    scalars = read_scalars(tmp_path)
    # Its output gradient exists from step 0 (inp trains), but it counts from its own step 2.
    for kind, stat in ((0, "grad_norm"), (1, "output_grad_norm")):
        want = np.mean([step[kind]["late"] for step in model.steps[2:]])
        ((_, value),) = scalars[f"grad_flow/{stat}/late"]
        assert math.isclose(value, want, rel_tol=1e-5), stat
    assert hooks_left(model) == []
