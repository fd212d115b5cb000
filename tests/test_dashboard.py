"""The custom-scalars dashboard and its bound on deep models, read back from real event files."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import GradFlowCallback
from lightning_hooks.core.alarms import ALARM_RULES
from lightning_hooks.logging.tensorboard import MAX_CHARTS
from lightning_hooks.tags import NOTICES

from conftest import (
    BoundedMLP,
    TinyMLP,
    default_callback_types,
    epoch_end_step,
    make_trainer,
    read_scalars,
)
from tensorboard_server import charts, read_layouts

_KINDS = {
    "alarms": tuple(rule for rule in ALARM_RULES if rule not in NOTICES),
    "notices": tuple(NOTICES),
}
"""The rules counted under each kind of count tag at the default ``on_alarm``."""


def test_one_layout_per_run_one_chart_per_statistic_matching_every_layer(tmp_path: Path) -> None:
    make_trainer(tmp_path, max_epochs=3, callbacks=[GradFlowCallback()]).fit(TinyMLP())
    layouts = read_layouts(tmp_path)
    # At the first logging step (its step charts) and the first epoch end (the epoch's): not
    # once per epoch.
    assert len(layouts) == 2, "the layout must be written when charts appear, not per epoch"
    found = charts(layouts[-1])
    scalar_tags = [t for t in read_scalars(tmp_path) if t.startswith("grad_flow/")]
    stats = {tag.split("/")[1] for tag in scalar_tags} - {"global"}
    counted = {"alarms", "alarms_step", "notices", "notices_step"}
    assert counted <= stats, "the default alarms log a count per rule, as a warning or a notice"
    # TinyMLP is a regressor with one output: no log-partition, no stability chart
    assert set(found) == {f"lightning_hooks: grad_flow/{s}" for s in stats - counted} | {
        f"lightning_hooks: {kind}/grad_flow{when}" for kind in _KINDS for when in ("", "_step")
    }
    for title, regexes in found.items():
        stat = title.rsplit("/", 1)[1]
        matched = {t for t in scalar_tags if any(re.match(r, t) for r in regexes)}
        kind = title.removeprefix("lightning_hooks: ").split("/")[0]
        if kind in _KINDS:  # one line per rule, never a layer
            stat = kind + ("_step" if title.endswith("_step") else "")
            rules = set(_KINDS[kind]) | ({"spike_score"} if stat == "alarms" else set())
            assert matched == {f"grad_flow/{stat}/{rule}" for rule in rules}
            continue
        layers = {f"grad_flow/{stat}/net.{i}" for i in (0, 2, 4)}
        overall = {f"grad_flow/global/{stat}"} & set(scalar_tags)
        assert matched == layers | overall
    assert any(
        "grad_flow/global/grad_norm" in r for r in found["lightning_hooks: grad_flow/grad_norm"][1:]
    )


def _fit(root: Path, max_layers: int | None) -> dict[str, list[tuple[int, float]]]:
    pl.seed_everything(7, verbose=False)
    callback = GradFlowCallback(max_layers_logged=max_layers, chart=False)
    make_trainer(root, callbacks=[callback]).fit(TinyMLP())
    return read_scalars(root)


def test_max_layers_logged_keeps_the_extremes_and_logs_percentiles(tmp_path: Path) -> None:
    full = _fit(tmp_path / "full", None)
    bounded = _fit(tmp_path / "bounded", 2)
    norms = {t.rsplit("/", 1)[1]: v[-1][1] for t, v in full.items() if "/grad_norm/" in t}
    assert len(norms) == 3
    extremes = {min(norms, key=norms.__getitem__), max(norms, key=norms.__getitem__)}
    logged = {t.rsplit("/", 1)[1] for t in bounded if "/grad_norm/" in t}
    assert logged == extremes
    for layer in extremes:
        tag = f"grad_flow/grad_norm/{layer}"
        assert bounded[tag][-1][1] == pytest.approx(full[tag][-1][1], rel=1e-6)
    expected = np.percentile(list(norms.values()), [5, 50, 95])
    got = [bounded[f"grad_flow/global/grad_norm_p{q:02d}"][-1][1] for q in (5, 50, 95)]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert not any("_p50" in t for t in full), "no percentiles below the bound"


def test_one_layer_logged_is_the_one_of_the_largest_gradient_norm(tmp_path: Path) -> None:
    """An odd place goes to the largest gradient norms: with ``max_layers_logged=1`` the layer
    logged is the one an explosion would show in, not the quietest."""
    full = _fit(tmp_path / "full", None)
    one = _fit(tmp_path / "one", 1)
    norms = {t.rsplit("/", 1)[1]: v[-1][1] for t, v in full.items() if "/grad_norm/" in t}
    logged = {t.rsplit("/", 1)[1] for t in one if "/grad_norm/" in t}
    assert logged == {max(norms, key=norms.__getitem__)}


class SpareMLP(TinyMLP):
    """TinyMLP with two layers its forward never runs: they get no gradient at all."""

    def __init__(self) -> None:
        super().__init__()
        self.spare = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])


def test_layers_without_a_gradient_take_no_place_among_the_layers_logged(tmp_path: Path) -> None:
    pl.seed_everything(7, verbose=False)
    full = GradFlowCallback(max_layers_logged=None, chart=False)
    make_trainer(tmp_path / "full", callbacks=[full]).fit(SpareMLP())
    pl.seed_everything(7, verbose=False)
    bounded = GradFlowCallback(max_layers_logged=2, chart=False)
    make_trainer(tmp_path / "bounded", callbacks=[bounded]).fit(SpareMLP())
    norms = {
        t.rsplit("/", 1)[1]: v[-1][1]
        for t, v in read_scalars(tmp_path / "full").items()
        if "/grad_norm/" in t
    }
    assert set(norms) == {"net.0", "net.2", "net.4"}  # the spare layers have no value
    extremes = {min(norms, key=norms.__getitem__), max(norms, key=norms.__getitem__)}
    logged = {t.rsplit("/", 1)[1] for t in read_scalars(tmp_path / "bounded") if "/grad_norm/" in t}
    assert logged == extremes


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_max_layers_logged_is_validated(bad: Any) -> None:
    with pytest.raises(
        ValueError, match=r"max_layers_logged=.*positive int or None \(every layer\), got"
    ):
        GradFlowCallback(max_layers_logged=bad)


class DeepMLP(pl.LightningModule):
    """1,000 ``Linear(4, 4)`` layers with tanh between them."""

    def __init__(self, depth: int = 1000) -> None:
        super().__init__()
        self.net = nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(depth)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        return DataLoader(TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 4)), 4)


def test_a_thousand_layer_mlp_stays_bounded(tmp_path: Path) -> None:
    make_trainer(tmp_path, callbacks=[GradFlowCallback(heatmap=True)]).fit(DeepMLP())
    tags = [t for t in read_scalars(tmp_path) if t.startswith("grad_flow/")]
    counts = {t for t in tags if t.startswith(("grad_flow/alarms/", "grad_flow/notices/"))}
    assert counts == {
        *(f"grad_flow/{kind}/{rule}" for kind, rules in _KINDS.items() for rule in rules),
        "grad_flow/alarms/spike_score",
    }
    per_layer = [t for t in tags if not t.startswith(("grad_flow/global/", "grad_flow/alarms"))]
    per_layer = [t for t in per_layer if not t.startswith("grad_flow/notices")]
    layers = {t.rsplit("/", 1)[1] for t in per_layer}
    assert len(layers) == 100, "max_layers_logged=100 by default"
    # 10 statistics per epoch, 7 per logging step (no *_max: one step)
    assert len(per_layer) <= (10 + 7) * 100
    # per layer, global, percentiles, one count per alarm rule; per epoch and per logging step
    assert len(tags) <= (10 + 7) * (100 + 1 + 3) + 2 + 2 * len(ALARM_RULES) + 1
    layout = read_layouts(tmp_path)[-1]  # the last one written is the one TensorBoard shows
    # one chart per statistic, one for the alarms and one for the notices, per epoch and per
    # step, and two for the output layer's log Z, per epoch and per step, whatever the depth
    assert len(charts(layout)) == 10 + 7 + 2 * 2 + 2 * 2 <= MAX_CHARTS
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"images": 0})
    acc.Reload()
    (image,) = acc.Images("grad_flow/chart")
    assert image.width <= 24 * 100 and image.height <= 5 * 100, "figure size is capped"
    (image,) = acc.Images("grad_flow/heatmap")
    assert image.width <= 24 * 100 and image.height <= 12 * 100, "figure size is capped"


def test_heatmap_holds_the_logged_gradient_norms_per_layer_and_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning_hooks.callbacks.grad_flow_pictures as module

    drawn: list[tuple[list[str], list[int], np.ndarray]] = []
    scales: list[bool] = []
    original = module.layer_epoch_heatmap

    def spy(
        layers: Any, epochs: Any, values: np.ndarray, title: str = "", log: bool = False
    ) -> Any:
        drawn.append((list(layers), list(epochs), values.copy()))
        scales.append(log)
        return original(layers, epochs, values, title, log=log)

    monkeypatch.setattr(module, "layer_epoch_heatmap", spy)
    callback = GradFlowCallback(heatmap=True, chart=False)
    make_trainer(tmp_path, max_epochs=3, callbacks=[callback]).fit(TinyMLP())
    layers, epochs, values = drawn[-1]
    assert len(drawn) == 3 and epochs == [0, 1, 2] and layers == ["net.0", "net.2", "net.4"]
    assert scales == [True] * 3, "gradient norms span decades: the heatmap's colours are log"
    scalars = read_scalars(tmp_path)
    for row, layer in enumerate(layers):
        logged = [v for _, v in scalars[f"grad_flow/grad_norm/{layer}"]]
        np.testing.assert_allclose(values[row], logged, rtol=1e-6)
    acc = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"images": 0})
    acc.Reload()
    assert acc.Tags()["images"] == ["grad_flow/heatmap"]
    assert [e.step for e in acc.Images("grad_flow/heatmap")] == [
        epoch_end_step(4 * epoch) for epoch in (1, 2, 3)
    ]


def test_the_dashboard_leads_with_gradient_flow_then_alarms_and_notices(tmp_path: Path) -> None:
    callbacks = [cls() for cls in default_callback_types()]
    make_trainer(tmp_path, callbacks=callbacks).fit(BoundedMLP())
    layout = read_layouts(tmp_path)[-1]  # the last one written is the one TensorBoard shows
    titles = [c.title.split(": ")[1] for c in layout.category]
    families = {t.split("/")[0] for t in read_scalars(tmp_path) if t.count("/") >= 2}
    rest = sorted(families - {"grad_flow", "activations", "dead_relu"})
    assert titles == ["grad_flow", "alarms", "notices", "activations", "dead_relu", *rest]
    assert [c.title for c in layout.category[0].chart][:4] == [
        "grad_norm",
        "grad_norm_step",
        "output_grad_norm",
        "output_grad_norm_step",
    ]
