"""DeadReLUCallback through a real ``Trainer.fit``, read back from TensorBoard event files."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from ops import OpsPerStep
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import ActivationStatsCallback, DeadReLUCallback, LightningHooksWarning

from conftest import (
    TinyCNN,
    TinyMLP,
    dataset,
    epoch_end_step,
    hooks_left,
    make_trainer,
    read_scalars,
)
from syncs import SyncWindow, count_syncs

DEAD = [1, 4, 6, 9, 13]  # units of net.0 whose bias keeps them negative for every input


def _kill(bias: torch.Tensor, units: list[int]) -> None:
    with torch.no_grad():
        bias[units] = -1e3


class RecordingMLP(TinyMLP):
    """Records every activation output of training forwards; ``k`` units of net.0 forced dead.

    Validation inputs are 1e5 times larger: counted, they would make the dead units fire.
    """

    def __init__(self, activation: type[nn.Module] = nn.ReLU, inplace: bool = False) -> None:
        super().__init__(inplace=inplace)
        if activation is not nn.ReLU:
            self.net[1], self.net[3] = activation(), activation()
        _kill(self.net[0].bias, DEAD)
        self.outputs: dict[str, list[torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, module in enumerate(self.net):
            x = module(x)
            if i in (1, 3) and self.training and torch.is_grad_enabled():
                self.outputs.setdefault(f"net.{i}", []).append(x.detach().clone())
        return x

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def val_dataloader(self) -> DataLoader[Any]:
        x, y = dataset(16, seed=1).tensors
        return DataLoader(TensorDataset(x * 1e5, y), batch_size=8)


def _reference(outputs: list[torch.Tensor], dim: int) -> tuple[int, int, float]:
    """(dead units, units, mean over calls of the fraction of outputs <= 0), in plain torch."""
    stacked = torch.cat([o.movedim(dim, -1).reshape(-1, o.shape[dim]) for o in outputs])
    dead = int((stacked > 0).sum(dim=0).eq(0).sum())
    zero = sum(float((o <= 0).double().mean()) for o in outputs) / len(outputs)
    return dead, stacked.shape[1], zero


def _logged(
    scalars: dict[str, list[tuple[int, float]]], stat: str, layer: str, stepped: int
) -> float:
    """The epoch value of ``stat`` at the epoch's end, once ``stepped`` batches have stepped."""
    return dict(scalars[f"dead_relu/{stat}/{layer}"])[epoch_end_step(stepped)]


class ReluStack(TinyMLP):
    """``depth`` x (Linear(16), ReLU) after TinyMLP's first layer."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        layers = [nn.Linear(8, 16), nn.ReLU()]
        layers += [m for _ in range(depth - 1) for m in (nn.Linear(16, 16), nn.ReLU())]
        self.net = nn.Sequential(*layers, nn.Linear(16, 1))


def test_beside_the_activation_statistics_a_relu_output_costs_no_op_of_its_own(
    trainer_factory: Any, tmp_path: Path
) -> None:
    """The dead units are counted from the copy of each small ReLU output that the activation
    statistics take anyway, compared a stack at a time: what ``DeadReLUCallback`` adds to a
    logging step does not grow with the number of ReLUs; the counts stay plain torch's."""
    added = []
    for depth in (2, 5):
        alone, both = OpsPerStep(), OpsPerStep()
        activations = ActivationStatsCallback(every_n_steps=1)
        trainer_factory(callbacks=[alone, activations]).fit(ReluStack(depth))
        activations = ActivationStatsCallback(every_n_steps=1)
        dead = DeadReLUCallback(every_n_steps=1, warn_at=1.0)
        trainer_factory(callbacks=[both, activations, dead]).fit(ReluStack(depth))
        added.append([b - a for a, b in zip(alone.per_step, both.per_step, strict=True)][1:3])
    assert added[0] == added[1]  # steps 1 and 2: logging steps past the first
    model = RecordingMLP(inplace=True)
    callbacks = [
        ActivationStatsCallback(every_n_steps=1),
        DeadReLUCallback(every_n_steps=1, warn_at=1.0),
    ]
    make_trainer(tmp_path / "recorded", callbacks=callbacks).fit(model)
    scalars = read_scalars(tmp_path / "recorded")
    for layer in ("net.1", "net.3"):
        dead_units, _, zero = _reference(model.outputs[layer], dim=1)
        assert _logged(scalars, "dead_count", layer, 4) == dead_units
        assert _logged(scalars, "zero_fraction", layer, 4) == pytest.approx(zero, rel=1e-6)


@pytest.mark.parametrize(
    ("activation", "inplace"), [(nn.ReLU, False), (nn.ReLU, True), (nn.GELU, False)]
)
def test_k_of_n_dead_and_zero_fraction_equal_plain_torch(
    activation: type[nn.Module], inplace: bool, trainer_factory: Any, tmp_path: Path
) -> None:
    model = RecordingMLP(activation, inplace)
    callback = DeadReLUCallback(warn_at=1.0)
    trainer_factory(callbacks=[callback], max_epochs=2, num_sanity_val_steps=2).fit(model)
    scalars = read_scalars(tmp_path)
    for epoch in range(2):
        at = 4 * (epoch + 1)
        for layer in ("net.1", "net.3"):
            dead, units, zero = _reference(model.outputs[layer][4 * epoch : at], dim=1)
            assert _logged(scalars, "dead_count", layer, at) == dead
            assert _logged(scalars, "dead_fraction", layer, at) == pytest.approx(dead / units)
            assert _logged(scalars, "zero_fraction", layer, at) == pytest.approx(zero, rel=1e-6)
        assert _logged(scalars, "dead_count", "net.1", at) == len(DEAD)
        assert _logged(scalars, "dead_fraction", "net.1", at) == pytest.approx(len(DEAD) / 16)
    assert hooks_left(model) == []


def test_warns_once_per_layer_per_fit_and_counts_the_rest(
    trainer_factory: Any, tmp_path: Path
) -> None:
    torch.manual_seed(0)  # the suite's order must not decide the random initialization
    model = RecordingMLP()
    _kill(model.net[2].bias, [0, 2, 4, 6])  # net.3: at least 4 of 16 units dead every epoch
    callback = DeadReLUCallback(warn_at=0.25)
    with pytest.warns(LightningHooksWarning) as rec:
        trainer_factory(callbacks=[callback], max_epochs=3).fit(model)
    scalars = read_scalars(tmp_path)
    crossed = {
        layer: [e for e in range(3) if _logged(scalars, "dead_fraction", layer, 4 * e + 4) >= 0.25]
        for layer in ("net.1", "net.3")
    }
    assert crossed == {"net.1": [0, 1, 2], "net.3": [0, 1, 2]}
    messages = [str(w.message) for w in rec if w.category is LightningHooksWarning]
    assert len(messages) == 3  # one per layer, one summary: not 6
    assert "'net.1' has 5 of 16 units dead in epoch 0" in messages[0]
    dead3 = int(_logged(scalars, "dead_count", "net.3", 4))
    assert f"'net.3' has {dead3} of 16 units dead in epoch 0" in messages[1]
    assert messages[2] == (
        "DeadReLUCallback: 4 more dead-unit findings held back after the first warning per "
        "layer: net.1 x2, net.3 x2"
    )
    # A second fit warns afresh, and with nothing held back it has no summary.
    with pytest.warns(LightningHooksWarning) as again:
        make_trainer(tmp_path / "second", callbacks=[callback]).fit(model)
    assert [
        str(w.message).split(" has")[0] for w in again if w.category is LightningHooksWarning
    ] == [
        "DeadReLUCallback: layer 'net.1'",
        "DeadReLUCallback: layer 'net.3'",
    ]


def test_below_threshold_does_not_warn(trainer_factory: Any, tmp_path: Path) -> None:
    """5 of net.1's 16 units dead (31 %), none of net.3's: under ``warn_at=0.4``, no warning."""
    model = RecordingMLP()  # the DEAD units of net.0 never fire
    alive = [unit for unit in range(16) if unit not in DEAD]
    with torch.no_grad():  # every other unit fires for every input
        model.net[0].bias[alive] = 10.0
        model.net[2].bias.fill_(10.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_factory(callbacks=[DeadReLUCallback(warn_at=0.4)]).fit(model)
    assert not [w for w in caught if issubclass(w.category, LightningHooksWarning)]
    scalars = read_scalars(tmp_path)
    assert _logged(scalars, "dead_fraction", "net.1", 4) == pytest.approx(len(DEAD) / 16)
    assert _logged(scalars, "dead_fraction", "net.3", 4) == 0.0


class DeadChannelCNN(TinyCNN):
    """Channels 0, 3 and 5 of the first block are pushed negative by the BatchNorm shift;
    ``side`` x ``side`` inputs."""

    def __init__(self, side: int = 8) -> None:
        super().__init__()
        _kill(self.features[1].bias, [0, 3, 5])
        self.outputs: list[torch.Tensor] = []
        self.features[2].register_forward_hook(self._record)
        self.side = side

    def train_dataloader(self) -> DataLoader[Any]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(24, 3, self.side, self.side, generator=g)
        return DataLoader(TensorDataset(x, torch.randint(0, 4, (24,), generator=g)), batch_size=8)

    def _record(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if self.training and torch.is_grad_enabled():
            self.outputs.append(out.detach().clone())


@pytest.mark.parametrize("side", [8, 96], ids=["counted-at-step-end", "counted-in-its-hook"])
def test_conv_units_are_channels(side: int, trainer_factory: Any, tmp_path: Path) -> None:
    # A small output's fired mask is counted with the others of its shape at the end of the
    # step; one over STACKED elements (8 x 8 x 96 x 96) is counted in its hook.
    from lightning_hooks.core.ops.feature_stats import STACKED

    model = DeadChannelCNN(side)
    trainer_factory(callbacks=[DeadReLUCallback(include="features.2", warn_at=1.0)]).fit(model)
    assert (model.outputs[0].numel() > STACKED) == (side == 96)
    scalars = read_scalars(tmp_path)
    dead, units, zero = _reference(model.outputs, dim=1)
    assert (dead, units) == (3, 8)
    assert _logged(scalars, "dead_count", "features.2", 3) == 3
    assert _logged(scalars, "dead_fraction", "features.2", 3) == pytest.approx(3 / 8)
    assert _logged(scalars, "zero_fraction", "features.2", 3) == pytest.approx(zero, rel=1e-6)


class FunctionalReLU(pl.LightningModule):
    """``F.relu`` inside ``forward``, no activation module; a shared ReLU-free Linear used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)
        _kill(self.fc1.bias, DEAD)
        self.pre: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.training and torch.is_grad_enabled():
            self.pre.append(h.detach().clone())
        return self.fc2(nn.functional.relu(h))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(), batch_size=8)


def test_functional_relu_through_the_producing_layer(trainer_factory: Any, tmp_path: Path) -> None:
    model = FunctionalReLU()
    trainer_factory(callbacks=[DeadReLUCallback(pre_activation="fc1", warn_at=1.0)]).fit(model)
    scalars = read_scalars(tmp_path)
    dead, units, zero = _reference(model.pre, dim=1)
    assert (dead, units) == (len(DEAD), 16)
    assert _logged(scalars, "dead_count", "fc1", 4) == len(DEAD)
    assert _logged(scalars, "zero_fraction", "fc1", 4) == pytest.approx(zero, rel=1e-6)


def test_functional_relu_at_the_defaults_says_so_once_and_goes_on(
    trainer_factory: Any, tmp_path: Path
) -> None:
    model = FunctionalReLU()
    trainer = trainer_factory(callbacks=[DeadReLUCallback()])
    with pytest.warns(
        LightningHooksWarning, match=r"nothing in this fit.*pass pre_activation="
    ) as w:
        trainer.fit(model)
    assert len([x for x in w if issubclass(x.category, LightningHooksWarning)]) == 1
    assert trainer.global_step == 4 and hooks_left(model) == []
    assert not any(t.startswith("dead_relu/") for t in read_scalars(tmp_path))


def test_functional_relu_with_a_selection_fails_at_setup(trainer_factory: Any) -> None:
    model = FunctionalReLU()
    with pytest.raises(ValueError, match=r"DeadReLUCallback\(include=\('fc1',\)\): selects no"):
        trainer_factory(callbacks=[DeadReLUCallback(include="fc1")]).fit(model)
    assert hooks_left(model) == []


class TwiceCalled(TinyMLP):
    """One ReLU module applied twice per forward: to ``h`` and to ``-h``."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU()
        self.calls: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.net[0](x)
        a, b = self.act(h), self.act(-h)
        if self.training and torch.is_grad_enabled():
            self.calls += [a.detach().clone(), b.detach().clone()]
        return self.net[4](self.net[2](a + b))


def test_module_called_twice_counts_both_calls(trainer_factory: Any, tmp_path: Path) -> None:
    model = TwiceCalled()
    model.lr = 0.0  # the weights stay: the units stay dead in the first call
    _kill(model.net[0].bias, DEAD)  # dead in the first call, firing in the second
    trainer_factory(callbacks=[DeadReLUCallback(include="act", warn_at=1.0)]).fit(model)
    scalars = read_scalars(tmp_path)
    dead, _, zero = _reference(model.calls, dim=1)
    assert dead == 0 and _reference(model.calls[::2], dim=1)[0] >= len(DEAD)
    assert _logged(scalars, "dead_count", "act", 4) == 0
    assert _logged(scalars, "zero_fraction", "act", 4) == pytest.approx(zero, rel=1e-6)


def test_no_host_sync_between_logging_steps(
    trainer_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = SyncWindow()
    with count_syncs(monkeypatch) as counter:
        probe.counter = counter
        callback = DeadReLUCallback(warn_at=1.0)
        trainer_factory(callbacks=[probe, callback], max_epochs=2).fit(RecordingMLP())
    assert probe.windows == 2
    assert dict(counter.calls) == {}


def test_arguments_are_checked_and_named() -> None:
    with pytest.raises(
        ValueError,
        match=r"DeadReLUCallback\(warn_at=2\): must be a finite real >= 0.0 and <= 1.0",
    ):
        DeadReLUCallback(warn_at=2)
    with pytest.raises(TypeError, match=r"DeadReLUCallback\(warn_at=.x.\): must be a finite real"):
        DeadReLUCallback(warn_at="x")  # type: ignore[arg-type]
    for removed in ("threshold", "warn"):  # the unreleased aliases of warn_at are gone
        with pytest.raises(
            TypeError, match=rf"DeadReLUCallback\({removed}=...\): unknown argument"
        ):
            DeadReLUCallback(**{removed: 0.3})
    with pytest.raises(TypeError, match=r"DeadReLUCallback\(types=3\): must be an nn.Module"):
        DeadReLUCallback(types=3)  # type: ignore[arg-type]


class TwoWidths(TinyMLP):
    """One ReLU module called at two widths per forward, as torchvision's ``Bottleneck`` calls
    its ``relu`` at 64, 64 and 256 channels: after a 16-wide layer and after an 8-wide one."""

    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU()
        self.wide, self.narrow = nn.Linear(8, 16), nn.Linear(16, 8)
        self.head = nn.Linear(8, 1)
        self.calls: dict[int, list[torch.Tensor]] = {16: [], 8: []}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.act(self.wide(x))
        b = self.act(self.narrow(a))
        if self.training and torch.is_grad_enabled():
            self.calls[16].append(a.detach().clone())
            self.calls[8].append(b.detach().clone())
        return self.head(b)


def test_a_module_called_at_two_widths_gets_a_row_per_width(
    trainer_factory: Any, tmp_path: Path
) -> None:
    # torchvision's ResNets call one ReLU module at several widths: a row per width, rather than
    # a refusal that would leave DeadReLUCallback() measuring nothing on them.
    model = TwoWidths()
    model.lr = 0.0  # the weights stay: the dead units stay dead
    _kill(model.wide.bias, DEAD)
    _kill(model.narrow.bias, [2, 5])
    with warnings.catch_warnings():
        warnings.simplefilter("error", LightningHooksWarning)
        trainer_factory(callbacks=[DeadReLUCallback(warn_at=1.0)]).fit(model)
    scalars = read_scalars(tmp_path)
    for layer, width in (("act", 16), ("act-8", 8)):
        dead, units, zero = _reference(model.calls[width], dim=1)
        assert units == width
        assert _logged(scalars, "dead_count", layer, 4) == dead
        assert _logged(scalars, "dead_fraction", layer, 4) == pytest.approx(dead / width)
        assert _logged(scalars, "zero_fraction", layer, 4) == pytest.approx(zero, rel=1e-6)
    assert _reference(model.calls[16], dim=1)[0] >= len(DEAD)
    assert _reference(model.calls[8], dim=1)[0] >= 2
    assert hooks_left(model) == []


class DeadChannelConv1d(pl.LightningModule):
    """Conv1d (4 channels, channel 0 dead) then ReLU: its ``[N, C, L]`` output looks like a
    transformer's ``[N, L, F]``, whose units are the last dimension. Sequences of ``lengths``."""

    def __init__(self, lengths: tuple[int, ...] = (16,)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv1d(1, 4, 3, padding=1), nn.ReLU())
        _kill(self.net[0].bias, [0])
        self.lengths = lengths
        self.outputs: list[torch.Tensor] = []
        self.net[1].register_forward_hook(self._record)

    def _record(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if self.training and torch.is_grad_enabled():
            self.outputs.append(out.detach().clone())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        length = self.lengths[batch_idx % len(self.lengths)]
        return self.net(batch[0][..., :length]).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def train_dataloader(self) -> DataLoader[Any]:
        x = torch.randn(32, 1, 24, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x), batch_size=8)


@pytest.mark.parametrize("lengths", [(16,), (16, 17, 18, 19, 20, 21)], ids=["fixed", "varying"])
def test_unit_dim_names_the_channels_of_a_conv1d_output(
    lengths: tuple[int, ...], trainer_factory: Any, tmp_path: Path
) -> None:
    """``unit_dim=1``: channel 0 of 4 is the one dead unit, whatever the sequence's length."""
    model = DeadChannelConv1d(lengths)
    callback = DeadReLUCallback(unit_dim=1, warn_at=None, every_n_steps=1)
    trainer_factory(callbacks=[callback]).fit(model)
    dead, units, _ = _reference(model.outputs, dim=1)
    assert (dead, units) == (1, 4)
    scalars = read_scalars(tmp_path)
    assert _logged(scalars, "dead_count", "net.1", 4) == 1
    assert _logged(scalars, "dead_fraction", "net.1", 4) == pytest.approx(1 / 4)


def test_unit_dim_is_checked_and_keys_its_own_checkpoint_state() -> None:
    with pytest.raises(TypeError, match=r"DeadReLUCallback\(unit_dim=1.5\): must be an int"):
        DeadReLUCallback(unit_dim=1.5)  # type: ignore[arg-type]
    assert DeadReLUCallback().state_key != DeadReLUCallback(unit_dim=1).state_key
    assert DeadReLUCallback().state_key == DeadReLUCallback(unit_dim=None).state_key
