"""ActivationStatsCallback through a real ``Trainer.fit``, read back from TensorBoard events."""

from __future__ import annotations

import importlib
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import ActivationStatsCallback, ActivationStatsTracker, LightningHooksWarning
from lightning_hooks.core import feature_stats
from lightning_hooks.core.ops.feature_stats import fused_feature_stats

from conftest import (
    TinyMLP,
    dataset,
    epoch_end_step,
    hooks_left,
    make_trainer,
    read_histograms,
    read_image_tags,
    read_scalars,
)
from syncs import SyncWindow, count_syncs


class RecordingMLP(TinyMLP):
    """Keeps, independently of the library, a copy of every layer output of training forwards.

    Validation batches are 1000x larger than training ones: counting them would show.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.outputs: dict[str, list[torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, module in enumerate(self.net):
            x = module(x)
            if self.training and torch.is_grad_enabled():
                self.outputs.setdefault(f"net.{i}", []).append(x.detach().clone())
        return x

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def val_dataloader(self) -> DataLoader[Any]:
        x, y = dataset(16, seed=1).tensors
        return DataLoader(TensorDataset(x * 1000.0, y), batch_size=8)


def _reference(outputs: list[torch.Tensor]) -> dict[str, float]:
    x = torch.cat([o.flatten() for o in outputs]).double()
    return {
        "mean": float(x.mean()),
        "std": float(x.std()),
        "min": float(x.min()),
        "max": float(x.max()),
        "abs_mean": float(x.abs().mean()),
        "zero_fraction": float((x == 0).double().mean()),
        "nonfinite": float((~torch.isfinite(x)).sum()),
        "kurtosis": float(((x - x.mean()) ** 4).mean() / ((x - x.mean()) ** 2).mean() ** 2),
        "outlier_ratio": float(x.abs().max() / x.square().mean().sqrt()),
    }


def _close(logged: float, want: float) -> bool:
    return math.isclose(logged, want, rel_tol=1e-5, abs_tol=1e-7)


@pytest.mark.parametrize("inplace", [False, True])
def test_logged_statistics_equal_plain_torch_over_each_epoch(
    inplace: bool, trainer_factory: Any, tmp_path: Path
) -> None:
    model = RecordingMLP(inplace=inplace)
    trainer = trainer_factory(
        callbacks=[ActivationStatsCallback()], max_epochs=2, num_sanity_val_steps=2
    )
    trainer.fit(model)
    scalars = read_scalars(tmp_path)
    layers = [f"net.{i}" for i in range(5)]
    assert sorted(t.rsplit("/", 1)[1] for t in scalars if t.startswith("activations/mean/")) == (
        layers
    )
    for epoch in range(2):
        at = epoch_end_step(4 * (epoch + 1))
        for layer in layers:
            want = _reference(model.outputs[layer][4 * epoch : 4 * (epoch + 1)])
            for stat, value in want.items():
                logged = dict(scalars[f"activations/{stat}/{layer}"])[at]
                assert _close(logged, value), (stat, layer, epoch, logged, value)
    for step in range(8):  # every step a logging step: its own outputs
        for layer in layers:
            want = _reference(model.outputs[layer][step : step + 1])
            for stat in ("kurtosis", "outlier_ratio"):
                logged = dict(scalars[f"activations/{stat}_step/{layer}"])[step]
                assert _close(logged, want[stat]), (stat, layer, step, logged, want[stat])
    assert 0 < dict(scalars["activations/zero_fraction/net.1"])[epoch_end_step(4)] < 1
    assert read_image_tags(tmp_path) == [
        "activations/heatmap/mean",
        "activations/heatmap/std",
        "activations/heatmap/zero_fraction",
    ]
    assert hooks_left(model) == []


class TwoOutputs(nn.Module):
    """Returns a tuple with a dict, an int and ``None`` in it."""

    def forward(self, x: torch.Tensor) -> Any:
        return x, {"double": 2 * x, "count": 3}, None


class SharedLayerModel(TinyMLP):
    """One ``Linear`` called twice per forward, and a module with a structured output."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.split = TwoOutputs()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.shared(x)
        b = self.shared(torch.relu(a))
        if self.training and torch.is_grad_enabled():
            self.seen += [a.detach().clone(), b.detach().clone()]
        out, extra, _ = self.split(b)
        return self.net(out + extra["double"])


def test_module_called_twice_pools_both_calls_and_tuple_outputs_get_suffixes(
    trainer_factory: Any, tmp_path: Path
) -> None:
    model = SharedLayerModel()
    callback = ActivationStatsCallback(
        types=(nn.Linear, TwoOutputs), include=["shared", "split"], heatmaps=False
    )
    trainer_factory(callbacks=[callback]).fit(model)
    scalars = read_scalars(tmp_path)
    want = _reference(model.seen)  # both calls of every training forward
    assert _close(dict(scalars["activations/mean/shared"])[epoch_end_step(4)], want["mean"])
    assert _close(dict(scalars["activations/std/shared"])[epoch_end_step(4)], want["std"])
    outputs = model.seen[1::2]
    assert _close(
        dict(scalars["activations/mean/split.0"])[epoch_end_step(4)], _reference(outputs)["mean"]
    )
    doubled = [2 * o for o in outputs]
    assert _close(
        dict(scalars["activations/max/split.1.double"])[epoch_end_step(4)],
        _reference(doubled)["max"],
    )
    assert not [t for t in scalars if "count" in t]


class PoisonedLinear(nn.Linear):
    """A ``Linear`` whose output is NaN in its third training forward."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.training and torch.is_grad_enabled():
            self.calls += 1
            if self.calls == 3:
                out = out * torch.nan
        return out


def test_first_nonfinite_module_and_step_are_named(trainer_factory: Any, tmp_path: Path) -> None:
    model = RecordingMLP()
    model.net[2] = PoisonedLinear(16, 16)
    with pytest.warns(
        LightningHooksWarning, match=r"non-finite.*'net\.2', at global step 2"
    ) as rec:
        trainer_factory(callbacks=[ActivationStatsCallback()], max_epochs=2).fit(model)
    assert len([w for w in rec if "non-finite" in str(w.message)]) == 1
    scalars = read_scalars(tmp_path)
    # The NaN step's update spreads NaN into the weights: net.0 goes non-finite in step 3 only.
    for layer in ("net.0", "net.2"):
        want = sum(int((~torch.isfinite(o)).sum()) for o in model.outputs[layer][:4])
        assert dict(scalars[f"activations/nonfinite/{layer}"])[epoch_end_step(4)] == want
    assert not torch.isfinite(model.outputs["net.2"][2]).any()
    assert torch.isfinite(model.outputs["net.0"][2]).all()
    assert math.isnan(dict(scalars["activations/mean/net.2"])[epoch_end_step(4)])


def _np_counts(values: torch.Tensor, edges: np.ndarray) -> np.ndarray:
    clipped = np.clip(values.double().numpy(), edges[0], edges[-1])
    counts, _ = np.histogram(clipped, bins=edges)
    return counts


def test_histograms_fixed_and_running_range(trainer_factory: Any, tmp_path: Path) -> None:
    model = RecordingMLP()
    fixed = ActivationStatsCallback(
        include="net.0", histograms=True, histogram_bins=8, histogram_range=(-1.0, 1.0)
    )
    trainer_factory(callbacks=[fixed], max_epochs=2).fit(model)
    ((step, hist), _) = read_histograms(tmp_path)["activations/histogram/net.0"]
    edges = torch.linspace(-1.0, 1.0, 9).double().numpy()
    values = torch.cat([o.flatten() for o in model.outputs["net.0"][:4]])
    assert step == epoch_end_step(4)
    np.testing.assert_allclose(hist.bucket_limit, edges[1:], rtol=1e-6)
    np.testing.assert_array_equal(hist.bucket, _np_counts(values, edges))
    assert hist.num == values.numel()
    assert math.isclose(hist.sum, float(values.double().sum()), rel_tol=1e-5)


def test_running_range_edges_span_the_previous_epoch(trainer_factory: Any, tmp_path: Path) -> None:
    model = RecordingMLP()
    running = ActivationStatsCallback(include="net.1", histograms=True, histogram_bins=5)
    trainer_factory(callbacks=[running], max_epochs=2).fit(model)
    (first, second) = read_histograms(tmp_path)["activations/histogram/net.1"]
    epoch0 = torch.cat([o.flatten() for o in model.outputs["net.1"][:4]])
    epoch1 = torch.cat([o.flatten() for o in model.outputs["net.1"][4:]])
    lo, hi = float(epoch0.min()), float(epoch0.max())
    edges = np.linspace(lo, hi, 6)
    np.testing.assert_allclose(second[1].bucket_limit, edges[1:], rtol=1e-5)
    np.testing.assert_array_equal(second[1].bucket, _np_counts(epoch1, edges))
    batch0 = model.outputs["net.1"][0].flatten()  # epoch 0: the range of the first output
    assert math.isclose(first[1].bucket_limit[-1], float(batch0.max()), rel_tol=1e-6)
    assert first[1].num == epoch0.numel()


def test_no_host_sync_between_logging_steps(
    trainer_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = SyncWindow()
    callback = ActivationStatsCallback(histograms=True)
    with count_syncs(monkeypatch) as counter:
        probe.counter = counter
        trainer_factory(callbacks=[probe, callback], max_epochs=2).fit(TinyMLP())
    assert probe.windows == 2
    assert dict(counter.calls) == {}


def test_half_precision_outputs_are_summed_in_float32() -> None:
    x = torch.full((70_000,), 1.0, dtype=torch.bfloat16)
    x[0] = -3.0
    stats = feature_stats(x)
    assert stats.dtype == torch.float32
    want = [69_996.0, 70_008.0, 70_002.0, 0.0, 0.0, 70_000.0]
    assert stats[:6].tolist() == pytest.approx(want, rel=1e-6)
    assert stats[6:].tolist() == [-3.0, 1.0]
    assert float(x.sum()) != 69_996.0  # bf16 accumulation would be wrong


def test_fused_statistics_equal_the_eager_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module("lightning_hooks.core.ops.feature_stats")
    compiled = module._compiled()
    calls: list[tuple[int, ...]] = []

    def counted(t: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(t.shape))
        return compiled(t)

    monkeypatch.setattr(module, "_compiled", lambda: counted)
    x = torch.randn(4, 3, 200, 200).relu()
    x[0, 0, 0, :3] = torch.tensor([torch.nan, torch.inf, -torch.inf])
    finite = x[1:]
    for tensor in (finite, finite.bfloat16(), x, x.transpose(0, 3), x[:1, :1, :8]):
        d = tensor.double()
        finite_count = torch.isfinite(d).sum()
        want = [d.sum(), d.square().sum(), d.abs().sum(), (d == 0).sum(), d.numel() - finite_count]
        want = torch.stack([*want, torch.tensor(d.numel()), d.amin(), d.amax()]).double()
        for got in (fused_feature_stats(tensor), feature_stats(tensor)):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0.0, equal_nan=True)
    assert fused_feature_stats(x)[4] == 3
    # The transposed (strided) tensor takes the eager path; the others compile.
    whole, part = (4, 3, 200, 200), (3, 3, 200, 200)
    assert calls == [part, part, whole, (1, 1, 8, 200), whole]


def test_outputs_read_in_pieces_give_the_whole_tensors_statistics() -> None:
    from lightning_hooks.core.ops.feature_stats import CHUNK

    x = torch.randn(2 * CHUNK + 1000, dtype=torch.float64).relu().float()
    x[CHUNK + 5 : CHUNK + 8] = torch.tensor([torch.nan, torch.inf, -torch.inf])
    x[-1] = -7.5  # the minimum, in the last, short piece
    got = feature_stats(x)
    finite = x[torch.isfinite(x)].double()
    assert got[3] == float((x == 0).sum()) and got[4] == 3 and got[5] == x.numel()
    assert all(math.isnan(got[i]) for i in (0, 1, 2, 6, 7))  # NaN propagates
    clean = feature_stats(finite.float())
    want = [finite.sum(), finite.square().sum(), finite.abs().sum()]
    torch.testing.assert_close(clean[:3].double(), torch.stack(want), rtol=1e-5, atol=0.0)
    assert clean[6:].tolist() == [-7.5, float(finite.max())]


class WideConv(pl.LightningModule):
    """One conv + ReLU whose output (655,360 elements) is read in two pieces; keeps its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 20, 3, padding=1), nn.ReLU())
        self.outputs: dict[str, list[torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, module in enumerate(self.net):
            x = module(x)
            self.outputs.setdefault(f"net.{i}", []).append(x.detach().clone())
        return x

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(16, 1, 64, 64, generator=g)), batch_size=8)


@pytest.mark.parametrize(
    ("options", "logging_step"),
    [({}, 1), ({"every_n_steps": 1}, 2), ({"every_n_steps": 1, "fused": True}, 2)],
    ids=["defaults", "every-step", "every-step-fused"],
)
def test_large_outputs_logged_statistics_equal_plain_torch(
    options: dict[str, Any], logging_step: int, trainer_factory: Any, tmp_path: Path
) -> None:
    # At the defaults, the Trainer's included (log_every_n_steps=50), only the epoch's first
    # step is a logging step.
    from lightning_hooks.core.ops.feature_stats import CHUNK

    model = WideConv()
    callback = ActivationStatsCallback(**options)
    trainer_factory(callbacks=[callback], max_epochs=1, log_every_n_steps=50).fit(model)
    scalars = read_scalars(tmp_path)
    for layer in ("net.0", "net.1"):
        assert len(model.outputs[layer]) == 2 and model.outputs[layer][0].numel() > CHUNK
        want = _reference(model.outputs[layer][:logging_step])
        for stat, value in want.items():
            logged = dict(scalars[f"activations/{stat}/{layer}"])[epoch_end_step(2)]
            assert _close(logged, value), (stat, layer, logged, value)
    assert 0.3 < dict(scalars["activations/zero_fraction/net.1"])[epoch_end_step(2)] < 0.7


def test_checkpoint_recompute_is_not_counted() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with ActivationStatsTracker(model, include="1") as tracker:
        x = torch.randn(16, 4, requires_grad=True)
        checkpoint(model, x, use_reentrant=False).sum().backward()
        assert tracker.summary().numel.tolist() == [128.0]


def test_arguments_are_checked_and_named(trainer_factory: Any) -> None:
    with pytest.raises(ValueError, match=r"histogram_bins=0\): must be a positive int, got 0"):
        ActivationStatsCallback(histogram_bins=0)
    with pytest.raises(ValueError, match=r"histogram_range=\(1.0, 0.0\)\): must be None or"):
        ActivationStatsCallback(histogram_range=(1.0, 0.0))
    with pytest.raises(
        TypeError, match=r"ActivationStatsCallback\(types=3\): must be an nn.Module"
    ):
        ActivationStatsCallback(types=3)  # type: ignore[arg-type]
    model = TinyMLP()
    with pytest.raises(ValueError, match=r"Callback\(include='net\.9'\) matches no.*'net\.0'"):
        trainer_factory(callbacks=[ActivationStatsCallback(include="net.9")]).fit(model)
    with pytest.raises(ValueError, match=r"Callback\(types=<class.*Conv2d'>\): selects no module"):
        trainer_factory(callbacks=[ActivationStatsCallback(types=nn.Conv2d)]).fit(model)
    assert hooks_left(model) == []


def test_the_activation_shape_in_batches_is_the_one_measured_output_by_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_hooks.core.stats import activation_shape

    def measured() -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).train()
        with activation_shape.ActivationShape().attach(model) as stat:
            for _ in range(3):
                model(torch.randn(5, 8))
            return stat.result()

    batched = measured()
    monkeypatch.setattr(activation_shape, "STACKED", 0)  # every output on its own
    alone = measured()
    assert batched[0] == alone[0] == ("0", "1", "2")
    for got, want in zip(batched[1:], alone[1:], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_a_state_saved_for_layers_in_another_order_adds_no_row() -> None:
    """A checkpoint state whose layers come in another order than the rows already made is
    refused before any row is made: a refused state leaves the statistic as it was."""
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)).train()
    with ActivationStatsTracker(model) as saved:
        model(torch.ones(4, 2))
        state = saved.host_state()
    assert tuple(state["layers"]) == ("0", "1")
    state["layers"] = ["1", "0"]
    with ActivationStatsTracker(model) as fresh:
        fresh.row("0")
        with pytest.raises(ValueError, match=r"saved for layers \('1', '0'\)"):
            fresh.load_host_state(state)
        assert fresh.layers == ("0",)


class FrozenFirstLayer(TinyMLP):
    """Its first Linear in eval mode for every epoch (a frozen backbone's usual set-up): a Linear
    computes the same in either mode, so its statistics are those of the model in train mode."""

    def on_train_epoch_start(self) -> None:
        self.net[0].eval()


def test_a_submodule_in_eval_mode_in_the_training_forward_is_measured(tmp_path: Path) -> None:
    runs = {}
    for name, model in (("frozen", FrozenFirstLayer), ("train", TinyMLP)):
        torch.manual_seed(0)
        callbacks = [ActivationStatsCallback(every_n_steps=1)]
        make_trainer(tmp_path / name, callbacks=callbacks).fit(model())
        runs[name] = read_scalars(tmp_path / name)
    assert "activations/mean/net.0" in runs["frozen"]
    assert runs["frozen"] == runs["train"]  # every tag and value, net.0's among them
