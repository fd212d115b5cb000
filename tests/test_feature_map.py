"""FeatureMapCallback: probe images, projector files, and a probe that leaves no trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import FeatureMapCallback, LayerTimeCallback
from lightning_hooks.core import LayerTimer, probe_mode
from lightning_hooks.logging import feature_map_grid

from conftest import TinyCNN, dataset, epoch_end_step, hooks_left, read_image_tags, read_scalars


class NoisyCNN(TinyCNN):
    """TinyCNN that draws from the RNG in every forward and keeps its first BatchNorm frozen."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x + 0.0 * torch.rand_like(x))

    def on_train_epoch_start(self) -> None:
        self.features[1].eval()


class Snapshot(pl.Callback):
    """Records modes, parameters, buffers and the RNG state at each epoch end."""

    def __init__(self) -> None:
        self.records: list[tuple[list[bool], dict[str, torch.Tensor], torch.Tensor]] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        modes = [m.training for m in pl_module.modules()]
        state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.records.append((modes, state, torch.random.get_rng_state()))


def _first_batch(model: pl.LightningModule) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = next(iter(model.train_dataloader()))
    return x, y


def test_images_scalars_and_projector_files_after_fit(trainer_factory: Any, tmp_path: Path) -> None:
    model = TinyCNN()
    callback = FeatureMapCallback(embedding="features.5", probe_size=6)
    trainer_factory(callbacks=[callback], max_epochs=2).fit(model)
    images = read_image_tags(tmp_path)
    assert {"feature_map/features.0", "feature_map/features.3"} <= set(images)
    x, y = _first_batch(model)
    model.eval()
    with torch.no_grad():
        conv0 = model.features[0](x[:6])
        conv1 = model.features[:4](x[:6])
        flat = model.features(x[:6]).flatten(1)
    scalars = read_scalars(tmp_path)
    for name, reference in (("features.0", conv0), ("features.3", conv1)):
        (_, _), (step, last) = scalars[f"feature_map/abs_mean/{name}"]
        assert step == epoch_end_step(6) and last == pytest.approx(
            float(reference.abs().mean()), rel=1e-5
        )
    logdir = tmp_path / "tb" / "version_0"
    assert (logdir / "projector_config.pbtxt").is_file()
    (embedding_dir,) = (logdir / f"{epoch_end_step(6):05d}").iterdir()
    rows = (embedding_dir / "tensors.tsv").read_text().strip().splitlines()
    assert len(rows) == 6 and len(rows[0].split("\t")) == flat.shape[1]
    logged = torch.tensor([[float(v) for v in row.split("\t")] for row in rows])
    torch.testing.assert_close(logged, flat, rtol=1e-4, atol=1e-5)
    labels = (embedding_dir / "metadata.tsv").read_text().split()
    assert labels == [str(v) for v in y[:6].tolist()]
    assert hooks_left(model) == []


def test_probe_leaves_modes_parameters_buffers_and_rng_bit_identical(
    trainer_factory: Any, tmp_path: Path
) -> None:
    model = NoisyCNN()
    before, after = Snapshot(), Snapshot()
    probe = FeatureMapCallback()
    timer = LayerTimeCallback(every_n_steps=1)
    trainer_factory(callbacks=[timer, before, probe, after], max_epochs=2).fit(model)
    assert len(before.records) == len(after.records) == 2
    for (modes_b, state_b, rng_b), (modes_a, state_a, rng_a) in zip(
        before.records, after.records, strict=True
    ):
        assert modes_b == modes_a and modes_b.count(False) == 1  # the frozen BatchNorm
        assert state_b.keys() == state_a.keys()
        for key in state_b:
            assert torch.equal(state_b[key], state_a[key]), key
        assert torch.equal(rng_b, rng_a)
    assert "feature_map/features.0" in read_image_tags(tmp_path)
    assert hooks_left(model) == []


def test_library_hooks_ignore_a_probe_forward_even_while_sampling() -> None:
    model = TinyCNN()
    timer = LayerTimer(model)
    timer.start_step()
    with probe_mode(model):
        model(torch.randn(2, 3, 8, 8))
    timer.end_step()
    assert timer.result().calls.tolist() == [0] * len(timer.layers)
    timer.remove()


class DictCNN(TinyCNN):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step((batch["image"], batch["label"]), batch_idx)

    def train_dataloader(self) -> DataLoader[Any]:
        x, y = _first_batch(TinyCNN())
        items = [{"image": xi, "label": yi} for xi, yi in zip(x, y, strict=True)]
        return DataLoader(items, batch_size=4)


def test_dict_batches_need_input_fn(trainer_factory: Any, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"input_fn=None\): cannot find the model input.*dict"):
        trainer_factory(callbacks=[FeatureMapCallback()]).fit(DictCNN())
    given = FeatureMapCallback(input_fn=lambda batch: batch["image"], layers="features.3")
    trainer_factory(callbacks=[given]).fit(DictCNN())
    assert read_image_tags(tmp_path) == ["feature_map/features.3"]


@pytest.mark.parametrize(
    ("input_fn", "match"),
    [
        (None, r"input_fn=None\): cannot find the model input in a batch of type dict"),
        (lambda batch: batch["x"], r"input_fn=<function .*\): raised KeyError: 'x' on the first"),
        (lambda batch: "image", r"input_fn=...\): the model input .* holds no tensor, got str"),
    ],
    ids=["no input_fn", "input_fn raises", "no tensor"],
)
def test_no_usable_input_stops_the_fit_at_its_first_batch_even_when_not_strict(
    trainer_factory: Any, input_fn: Any, match: str
) -> None:
    trainer = trainer_factory(callbacks=[FeatureMapCallback(input_fn=input_fn, strict=False)])
    with pytest.raises(TypeError, match=match):  # not the guard's warning: warnings are errors
        trainer.fit(DictCNN())
    assert trainer.global_step == 0


def test_a_user_probe_is_used_and_layers_are_spread(trainer_factory: Any, tmp_path: Path) -> None:
    model = TinyCNN()
    probe = torch.full((2, 3, 8, 8), 0.5)
    callback = FeatureMapCallback(probe=probe, layers="features.*", max_layers=3)
    trainer_factory(callbacks=[callback]).fit(model)
    assert read_image_tags(tmp_path) == [f"feature_map/features.{i}" for i in (0, 2, 5)]
    model.eval()
    with torch.no_grad():
        expected = model.features[:3](probe).abs().mean()
    ((_, value),) = read_scalars(tmp_path)["feature_map/abs_mean/features.2"]
    assert value == pytest.approx(float(expected), rel=1e-5)


def test_bad_arguments_name_the_culprit(trainer_factory: Any) -> None:
    with pytest.raises(ValueError, match=r"FeatureMapCallback\(channels=0\): must be a positive"):
        FeatureMapCallback(channels=0)
    with pytest.raises(
        ValueError, match=r"\(embedding='feature.9'\): .*matches no module.*closest"
    ):
        trainer_factory(callbacks=[FeatureMapCallback(embedding="feature.9")]).fit(TinyCNN())


def test_grid_tiles_channels_and_scales_each_to_unit_range() -> None:
    out = torch.stack([torch.arange(16.0).reshape(4, 4) * (c + 1) for c in range(3)])[None]
    grid = feature_map_grid(out, channels=2, min_size=8)
    assert grid.shape == (1, 8, 17)  # two 8x8 tiles (4x4 enlarged twice) and a 1-pixel gap
    assert grid[0, :, 8].eq(1).all()
    torch.testing.assert_close(grid[0, :8, :8], grid[0, :8, 9:])
    assert grid.min() == 0 and grid.max() == 1
    with pytest.raises(ValueError, match=r"2 to 5 dimensions, got shape \(3,\)"):
        feature_map_grid(torch.zeros(3))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"probe_size": "8"}, TypeError, r"\(probe_size='8'\): must be a positive int, got '8'"),
        ({"max_layers": 2.5}, TypeError, r"\(max_layers=2.5\): must be a positive int"),
        ({"input_fn": "x"}, TypeError, r"\(input_fn='x'\): must be a callable or None"),
        ({"forward_fn": 3}, TypeError, r"\(forward_fn=3\): must be a callable or None"),
        ({"embedding": 5}, TypeError, r"\(embedding=5\): must be a module name"),
        ({"probe_labels": [1, 2]}, TypeError, r"\(probe_labels=\[1, 2\]\): must be a tensor"),
    ],
)
def test_every_argument_is_checked_at_construction(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=r"FeatureMapCallback" + match):
        FeatureMapCallback(**kwargs)


def test_numpy_counts_are_accepted() -> None:
    import numpy as np

    callback = FeatureMapCallback(probe_size=np.int64(4), every_n_epochs=np.int32(2))
    assert (callback.probe_size, callback.every_n_epochs) == (4, 2)
    assert type(callback.probe_size) is int


class WideCNN(TinyCNN):
    """TinyCNN on 12x12 inputs with 3 channels: another model for the same callback."""

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(8, 3, 12, 12, generator=g)
        y = torch.randint(0, 4, (8,), generator=g)
        return DataLoader(TensorDataset(x, y), batch_size=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != 12:
            raise ValueError(f"WideCNN takes 12x12 inputs, got {tuple(x.shape)}")
        return super().forward(x)


def test_a_second_model_gets_its_own_probe(trainer_factory: Any, tmp_path: Path) -> None:
    callback = FeatureMapCallback(layers="features.0")
    trainer_factory(callbacks=[callback]).fit(TinyCNN())
    model = WideCNN()
    make = trainer_factory
    make(callbacks=[callback], logger=TensorBoardLogger(str(tmp_path), name="wide")).fit(model)
    (x, _), *_ = model.train_dataloader()
    model.eval()
    with torch.no_grad():
        expected = model.features[0](x).abs().mean()
    ((_, value),) = read_scalars(tmp_path / "wide")["feature_map/abs_mean/features.0"]
    assert value == pytest.approx(float(expected), rel=1e-5)


class NoForward(pl.LightningModule):
    """All the work in training_step: no forward() to run a probe through."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 4)
        self.head = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.head(self.body(x).relu()), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(), batch_size=8)


def test_a_module_without_forward_is_refused_at_setup_or_run_by_forward_fn(
    trainer_factory: Any, tmp_path: Path
) -> None:
    from lightning_fabric.utilities.exceptions import MisconfigurationException

    model = NoForward()
    trainer = trainer_factory(callbacks=[FeatureMapCallback()])
    with pytest.raises(
        MisconfigurationException, match=r"NoForward defines no forward\(\).*forward_fn"
    ):
        trainer.fit(model)
    assert trainer.global_step == 0  # said at setup, not after an epoch
    callback = FeatureMapCallback(forward_fn=lambda module, x: module.head(module.body(x).relu()))
    trainer_factory(callbacks=[callback]).fit(model)
    x, _ = next(iter(model.train_dataloader()))
    with torch.no_grad():
        expected = model.body(x).abs().mean()
    ((_, value),) = read_scalars(tmp_path)["feature_map/abs_mean/body"]
    assert value == pytest.approx(float(expected), rel=1e-5)
