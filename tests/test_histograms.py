"""Per-layer gradient histograms: counts on the device, read back from TensorBoard event files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins import MixedPrecision
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lightning_hooks import ActivationStatsCallback, GradFlowCallback
from lightning_hooks.core.ops.histogram import LOG10_EDGES, LayerHistograms, bin_counts

from conftest import TinyMLP, epoch_end_step, make_trainer, read_histograms, read_scalars
from syncs import SyncWindow, count_syncs

LAYERS = ("net.0", "net.2", "net.4")


class GradRecorder(pl.Callback):
    """Keeps a copy of every layer's gradient at every optimizer step, in plain torch."""

    def __init__(self) -> None:
        self.grads: dict[str, list[np.ndarray]] = {layer: [] for layer in LAYERS}

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
        for layer in LAYERS:
            params = pl_module.get_submodule(layer).parameters()
            self.grads[layer].append(torch.cat([p.grad.flatten() for p in params]).numpy().copy())


def test_histograms_equal_numpy_counts_of_the_recorded_gradients(tmp_path: Path) -> None:
    recorder = GradRecorder()
    callback = GradFlowCallback(histograms=True)
    make_trainer(tmp_path, max_epochs=2, callbacks=[recorder, callback]).fit(TinyMLP())
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"histograms": 0})
    acc.Reload()
    assert sorted(acc.Tags()["histograms"]) == [f"grad_flow/grad_log10_abs/{n}" for n in LAYERS]
    edges = LOG10_EDGES.double().numpy()
    for layer in LAYERS:
        events = acc.Histograms(f"grad_flow/grad_log10_abs/{layer}")
        assert [e.step for e in events] == [epoch_end_step(4), epoch_end_step(8)]
        for epoch, event in enumerate(events):
            grads = np.concatenate(recorder.grads[layer][4 * epoch : 4 * epoch + 4])
            with np.errstate(divide="ignore"):
                logs = np.log10(np.abs(grads).astype(np.float32))
            expected = np.bincount(np.digitize(logs, edges), minlength=len(edges) + 1)
            hist = event.histogram_value
            assert list(hist.bucket) == expected.tolist()
            assert hist.num == grads.size
            assert list(hist.bucket_limit)[:-1] == pytest.approx(edges.tolist())


def test_no_host_sync_between_logging_steps_with_histograms(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = SyncWindow()
    with count_syncs(monkeypatch) as counter:
        probe.counter = counter
        callbacks = [probe, GradFlowCallback(histograms=True)]
        make_trainer(tmp_path, max_epochs=2, callbacks=callbacks).fit(TinyMLP())
    assert probe.windows == 2
    assert dict(counter.calls) == {}


def test_non_finite_entries_are_not_counted() -> None:
    hist = LayerHistograms(1, edges=torch.tensor([0.0]))
    hist.update([torch.tensor([float("nan"), float("inf"), 0.5, 2.0])], [0])
    assert hist.host_counts().tolist() == [[1.0, 1.0]]


def test_one_binning_rule_for_linear_and_log_edges() -> None:
    values = torch.tensor([float("nan"), float("-inf"), -3.0, 0.0, 0.02, 0.3, 7.0])
    linear, log = torch.zeros(3), torch.zeros(3)
    bin_counts(values, torch.tensor([0.0, 0.5]), linear)
    bin_counts(values, torch.tensor([-1.0, 0.0]), log, "log10")
    finite = values[torch.isfinite(values)].numpy()
    assert linear.tolist() == np.bincount(np.digitize(finite, [0.0, 0.5]), minlength=3).tolist()
    with np.errstate(divide="ignore"):
        logs = np.log10(np.abs(finite))
    assert log.tolist() == np.bincount(np.digitize(logs, [-1.0, 0.0]), minlength=3).tolist()
    assert linear.sum() == log.sum() == finite.size  # NaN / Inf counted by neither


def test_activation_histograms_count_finite_values_only(tmp_path: Path) -> None:
    class Poisoned(TinyMLP):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(torch.where(x > 2.5, torch.nan, x))

    callback = ActivationStatsCallback(
        types=nn.Linear, histograms=True, heatmaps=False, warn_nonfinite=False
    )
    make_trainer(tmp_path, callbacks=[callback]).fit(Poisoned(lr=0.0))
    ((_, hist),) = read_histograms(tmp_path)["activations/histogram/net.0"]
    scalars = read_scalars(tmp_path)
    numel = 32 * 16
    nonfinite = dict(scalars["activations/nonfinite/net.0"])[epoch_end_step(4)]
    assert nonfinite > 0 and hist.num == sum(hist.bucket) == numel - nonfinite


def test_histograms_count_every_optimizer_step_not_only_the_logging_steps(tmp_path: Path) -> None:
    recorder = GradRecorder()
    callback = GradFlowCallback(histograms=True, every_n_steps=3)
    make_trainer(tmp_path, callbacks=[recorder, callback]).fit(TinyMLP())
    histograms = read_histograms(tmp_path)
    assert sorted(histograms) == [f"grad_flow/grad_log10_abs/{n}" for n in LAYERS]
    for layer in LAYERS:
        (_, hist), *_ = histograms[f"grad_flow/grad_log10_abs/{layer}"]
        first_epoch = recorder.grads[layer][:4]
        # the 4 steps of the first epoch, not only its 2 logging steps (0 and 2)
        assert hist.num == sum(grads.size for grads in first_epoch)


class FusedMLP(TinyMLP):
    """TinyMLP stepped by a fused Adam, which unscales the gradients inside its step."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3, fused=True)


def test_histograms_of_a_fused_optimizer_under_a_grad_scaler_count_the_unscaled_gradients(
    tmp_path: Path,
) -> None:
    # Lightning's own 16-mixed plugin with a real GradScaler on the CPU: Lightning leaves a
    # fused optimizer's gradients scaled (by 1024, a power of two: the division is exact).
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    recorder = GradRecorder()
    callback = GradFlowCallback(histograms=True)
    make_trainer(tmp_path, callbacks=[recorder, callback], plugins=[plugin]).fit(FusedMLP())
    edges = LOG10_EDGES.double().numpy()
    histograms = read_histograms(tmp_path)
    for layer in LAYERS:
        (_, hist), *_ = histograms[f"grad_flow/grad_log10_abs/{layer}"]
        grads = np.concatenate(recorder.grads[layer][:4]) / np.float32(1024.0)
        with np.errstate(divide="ignore"):
            logs = np.log10(np.abs(grads).astype(np.float32))
        expected = np.bincount(np.digitize(logs, edges), minlength=len(edges) + 1)
        assert list(hist.bucket) == expected.tolist()


def test_bf16_values_are_binned_against_the_float32_edges() -> None:
    """Edges 0.125 apart around 100, where bf16's spacing is 0.5: rounded to bf16, the edges would
    collapse onto each other and move counts to the next bin. Binned in float32, the counts are
    numpy's of the same values."""
    values = torch.linspace(98.0, 102.0, 1001).to(torch.bfloat16)
    inner = torch.linspace(98.0, 102.0, 33)[1:-1]
    out = torch.zeros(len(inner) + 1, dtype=torch.int64)
    bin_counts(values, inner, out)
    want = np.bincount(np.digitize(values.float().numpy(), inner.numpy()), minlength=len(out))
    assert out.tolist() == want.tolist()
