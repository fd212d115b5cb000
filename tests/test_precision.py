"""GradFlowCallback under every precision, with a real GradScaler, fused optimizers and clipping.

Each run is checked against :class:`ScaledReference`, which measures, with plain torch and in
float64, what each optimizer step applies, undoing the loss scale where AMP leaves it in place.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pytorch_lightning.plugins import MixedPrecision

from lightning_hooks import GradFlowCallback

from conftest import epoch_end_step, read_scalars
from support import LAYERS, ReferenceMLP

CHECKED = (
    ("grad_norm", "grad_norm", "grad_norm_max"),
    ("grad_abs_mean", "grad_abs_mean", None),
    ("grad_abs_max", None, "grad_abs_max"),
    ("weight_norm", "weight_norm", None),
    ("update_ratio", "update_ratio", "update_ratio_max"),
    ("output_grad_norm", "output_grad_norm", "output_grad_norm_max"),
)


class ScaledReference(ReferenceMLP):
    """The reference of test_grad_flow, in float64, unscaled by the GradScaler's current scale."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        self.postclip: list[float] = []
        self.applied: list[dict[str, dict[str, float]]] = []
        self.scales: list[float] = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.fused:
            return torch.optim.Adam(self.parameters(), lr=1e-3, fused=True)
        return super().configure_optimizers()

    def _add_out(self, name: str, grad: torch.Tensor) -> None:
        self._out_sq[name] += float(grad.double().pow(2).sum())

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        self.scales.append(scale)
        for name in LAYERS:
            self._out_sq[name] /= scale**2  # output gradients always carry the loss scale
        super().on_before_optimizer_step(optimizer)
        if self.fused:  # Lightning leaves a fused optimizer's gradients scaled
            for name in LAYERS:
                for stat in ("grad_norm", "grad_abs_mean", "grad_abs_max"):
                    self.steps[-1][name][stat] /= scale

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_idx)
        grads = [p.grad.double().flatten() for n in LAYERS for p in self._layer(n)]  # type: ignore[union-attr]
        self.postclip.append(float(torch.cat(grads).norm()))
        applied = {}  # p.grad after the step: what the optimizer applied, after any clipping
        for name in LAYERS:
            g = torch.cat([p.grad.double().flatten() for p in self._layer(name)])  # type: ignore[union-attr]
            applied[name] = {
                "grad_norm": float(g.norm()),
                "grad_abs_mean": float(g.abs().mean()),
                "grad_abs_max": float(g.abs().max()),
            }
        self.applied.append(applied)


def _check(model: ScaledReference, scalars: dict[str, list[tuple[int, float]]]) -> None:
    assert len(model.steps) == 4
    for layer in LAYERS:
        for stat, mean_tag, max_tag in CHECKED:
            values = np.array([s[layer][stat] for s in model.steps])
            for tag, want in ((mean_tag, values.mean()), (max_tag, values.max())):
                if tag is not None:
                    ((_, got),) = scalars[f"grad_flow/{tag}/{layer}"]
                    assert math.isclose(got, want, rel_tol=1e-5), (tag, layer, got, want)


@pytest.mark.parametrize("precision", ["32-true", "64-true", "bf16-mixed"])
def test_statistics_are_exact_under_each_precision(
    precision: str, trainer_factory: Any, tmp_path: Path
) -> None:
    model = ScaledReference()
    trainer_factory(callbacks=[GradFlowCallback()], precision=precision).fit(model)
    _check(model, read_scalars(tmp_path))
    want = torch.float64 if precision == "64-true" else torch.float32
    assert model.net[0].weight.dtype == want


@pytest.mark.parametrize("fused", [False, True], ids=["unscaled", "fused-left-scaled"])
def test_fp16_grad_scaler_on_cpu_is_divided_out(
    fused: bool, trainer_factory: Any, tmp_path: Path
) -> None:
    # Lightning's own 16-mixed plugin with a real GradScaler on the CPU (Trainer(precision=
    # "16-mixed") is CUDA-only): the output gradients carry the scale, and a fused optimizer's
    # parameter gradients too, since Lightning skips unscale_ for it.
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    model = ScaledReference(fused=fused)
    trainer_factory(callbacks=[GradFlowCallback()], plugins=[plugin]).fit(model)
    assert model.scales == [1024.0] * 4  # no overflow: every step applied, scale unchanged
    _check(model, read_scalars(tmp_path))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="precision='16-mixed' needs CUDA")
def test_fp16_mixed_on_cuda(trainer_factory: Any, tmp_path: Path) -> None:
    model = ScaledReference()
    trainer = trainer_factory(
        callbacks=[GradFlowCallback()], precision="16-mixed", accelerator="cuda"
    )
    trainer.fit(model)
    assert model.scales[0] > 1.0
    _check(model, read_scalars(tmp_path))


def _mean_max(values: list[float]) -> tuple[float, float]:
    return float(np.mean(values)), float(np.max(values))


def test_clipping_logs_the_applied_gradient_and_the_one_before_clipping(
    trainer_factory: Any, tmp_path: Path
) -> None:
    clip = 0.05
    model = ScaledReference()
    trainer_factory(callbacks=[GradFlowCallback()], gradient_clip_val=clip).fit(model)
    scalars = read_scalars(tmp_path)
    assert len(model.applied) == 4
    for layer in LAYERS:
        pre = [s[layer]["grad_norm"] for s in model.steps]  # before clipping, plain torch
        ((_, got),) = scalars[f"grad_flow/grad_norm_preclip/{layer}"]
        assert math.isclose(got, float(np.mean(pre)), rel_tol=1e-5), layer
        for stat, mean_tag, max_tag in CHECKED[:3]:
            mean, peak = _mean_max([s[layer][stat] for s in model.applied])
            for tag, want in ((mean_tag, mean), (max_tag, peak)):
                if tag is not None:
                    ((_, got),) = scalars[f"grad_flow/{tag}/{layer}"]
                    assert math.isclose(got, want, rel_tol=1e-5), (tag, layer, got, want)
        # the applied gradient is the clipped one: smaller than before clipping
        epoch = epoch_end_step(4)
        assert dict(scalars[f"grad_flow/grad_norm/{layer}"])[epoch] < float(np.mean(pre))
    pre = [math.sqrt(sum(s[n]["grad_norm"] ** 2 for n in LAYERS)) for s in model.steps]
    ((_, pre_logged),) = scalars["grad_flow/global/grad_norm_preclip"]
    ((_, post_logged),) = scalars["grad_flow/global/grad_norm_postclip"]
    ((_, applied_logged),) = scalars["grad_flow/global/grad_norm"]
    assert math.isclose(pre_logged, float(np.mean(pre)), rel_tol=1e-5)
    assert math.isclose(post_logged, float(np.mean(model.postclip)), rel_tol=1e-5)
    assert applied_logged == post_logged
    assert min(pre) > clip  # every step was clipped, to clip_grad_norm_'s clip / (norm + 1e-6)
    assert math.isclose(post_logged, clip, rel_tol=1e-4)


def test_no_clip_tags_without_clipping(trainer_factory: Any, tmp_path: Path) -> None:
    trainer_factory(callbacks=[GradFlowCallback()]).fit(ScaledReference())
    assert not [t for t in read_scalars(tmp_path) if "clip" in t]
