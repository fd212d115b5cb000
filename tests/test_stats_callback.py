"""StatsCallback and the one Selection: the example statistic, argument errors, naming."""

from __future__ import annotations

import re
import runpy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from lightning_hooks import (
    ActivationStatsCallback,
    DeadReLUCallback,
    GradFlowCallback,
    LayerStat,
    LayerTimeCallback,
    SaturationCallback,
)
from lightning_hooks.callbacks.stats import StatsCallback
from lightning_hooks.core import (
    ActivationStatsTracker,
    DeadUnitTracker,
    LayerTimer,
    SaturationTracker,
)
from lightning_hooks.core.hooks.selection import Selection
from lightning_hooks.core.stats.activation_shape import ActivationShape

from conftest import TinyMLP, epoch_end_step, hooks_left, make_trainer, read_scalars

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_stat.py"


def test_the_example_logs_its_statistic_every_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    scalars = read_scalars(tmp_path / "runs" / "custom_stat")
    assert sorted(t for t in scalars if t.startswith("output_rms/")) == [
        "output_rms/net.0",
        "output_rms/net.0_step",
        "output_rms/net.2",
        "output_rms/net.2_step",
    ]
    epochs = [epoch_end_step(8 * epoch) for epoch in (1, 2, 3)]  # 3 epochs of 8 steps
    assert [s for s, _ in scalars["output_rms/net.0"]] == epochs
    assert [s for s, _ in scalars["weights/peak/net.2"]] == epochs


def test_a_parameter_statistic_from_public_names_matches_plain_torch(tmp_path: Path) -> None:
    """``WeightPeak`` (imports only ``lightning_hooks``) logs each epoch's largest |w| over the
    logging steps' forwards: the weights as each of those forwards saw them."""
    weight_peak: Any = runpy.run_path(str(EXAMPLE))["WeightPeak"]
    seen: list[float] = []
    model = TinyMLP()
    model.net[2].register_forward_pre_hook(
        lambda m, args: seen.append(float(m.weight.detach().abs().max())) if m.training else None
    )
    make_trainer(tmp_path, callbacks=[StatsCallback(weight_peak(), every_n_steps=2)]).fit(model)
    logged = dict(read_scalars(tmp_path)["weights/peak/net.2"])[epoch_end_step(4)]
    assert logged == pytest.approx(max(seen[0], seen[1], seen[3]), rel=1e-6)  # steps 0, 1, 3
    model.net[2]._forward_pre_hooks.clear()
    assert hooks_left(model) == []


def test_a_user_statistic_matches_plain_torch_in_a_fit(tmp_path: Path) -> None:
    output_rms: Any = runpy.run_path(str(EXAMPLE))["OutputRMS"]
    outputs: list[torch.Tensor] = []
    model = TinyMLP()
    model.net[2].register_forward_hook(
        lambda m, a, out: outputs.append(out.detach().clone()) if m.training else None
    )
    stat = output_rms()
    make_trainer(tmp_path, callbacks=[StatsCallback(stat, every_n_steps=2)]).fit(model)
    logging_step = torch.cat([outputs[0], outputs[1], outputs[3]])  # steps 0, 1 and 3 of 4
    logged = dict(read_scalars(tmp_path)["output_rms/net.2"])[epoch_end_step(4)]
    assert np.isclose(logged, float(logging_step.square().mean().sqrt()), rtol=1e-6)
    model.net[2]._forward_hooks.clear()
    assert hooks_left(model) == []


def test_stats_callback_refuses_what_is_not_a_layer_stat() -> None:
    with pytest.raises(TypeError, match=r"StatsCallback\(stats=\[\]\): must be a LayerStat"):
        StatsCallback([])
    with pytest.raises(TypeError, match=r"StatsCallback\(stats=3\): must be a LayerStat"):
        StatsCallback(3)  # type: ignore[arg-type]


def test_a_statistic_without_summarize_or_tags_is_refused_when_made() -> None:
    class Half(LayerStat[float]):
        def summarize(self, states: dict[str, np.ndarray]) -> float:
            return 0.0

    with pytest.raises(TypeError, match=r"abstract class Half .*tags"):
        Half()


@pytest.mark.parametrize(
    ("make", "argument"),
    [
        (lambda: DeadReLUCallback(pre_activation="net.9"), "DeadReLUCallback(pre_activation="),
        (lambda: DeadReLUCallback(include="net.9"), "DeadReLUCallback(include="),
        (lambda: ActivationStatsCallback(exclude="net.9"), "ActivationStatsCallback(exclude="),
        (lambda: SaturationCallback(include="net.9"), "SaturationCallback(include="),
        (lambda: LayerTimeCallback(include="net.9"), "LayerTimeCallback(include="),
    ],
)
def test_a_pattern_matching_nothing_names_the_argument_the_user_passed(
    make: Any, argument: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{argument}'net.9') matches no")):
        make_trainer(tmp_path, callbacks=[make()]).fit(TinyMLP())


def test_selection_validates_types_and_patterns_once() -> None:
    with pytest.raises(TypeError, match=r"Cb\(types=3\): must be an nn.Module subclass"):
        Selection.of("Cb", types=3)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"Cb\(layers=\[1\]\): must be a glob pattern \(str\).*got 1"
    ):
        Selection.of("Cb", include=[1], arguments=("layers", "exclude"))  # type: ignore[list-item]
    picked = Selection.of("Cb", types=nn.Linear, exclude="net.4").modules(TinyMLP())
    assert [name for name, _ in picked] == ["net.0", "net.2"]


class _Declares(LayerStat[float]):
    """A statistic that declares one state with the options it is given."""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.add_layer_state("peak", **options)

    def summarize(self, states: dict[str, np.ndarray]) -> float:
        return 0.0

    def tags(self, result: float) -> dict[str, float]:
        return {}


def test_a_misspelt_state_option_is_named_with_the_closest_and_every_option() -> None:
    with pytest.raises(
        TypeError,
        match=r"^_Declares\.add_layer_state\(widht=\.\.\.\): unknown argument "
        r"\(did you mean 'width'\?\); the arguments are name, reduce, width, dtype, fill, kind$",
    ):
        _Declares(reduce="max", widht=(2,))


def test_a_state_without_reduce_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match=r"add_layer_state\(\) missing .*argument: 'reduce'"):
        _Declares(width=(2,))


def test_a_state_takes_every_option_by_keyword() -> None:
    stat = _Declares(reduce="max", width=(2,), dtype=torch.float32, fill=0.0, kind="layer")
    spec = stat.specs["peak"]
    assert (spec.reduce, spec.width, spec.dtype, spec.fill, spec.kind) == (
        "max",
        (2,),
        torch.float32,
        0.0,
        "layer",
    )
    stat.row("net.0")
    assert stat.peak.tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize(
    "make",
    [ActivationStatsTracker, ActivationShape, DeadUnitTracker, LayerTimer, SaturationTracker],
)
def test_a_statistic_names_the_closest_to_a_misspelt_selection_keyword(make: Any) -> None:
    name = make.__name__
    with pytest.raises(
        TypeError,
        match=rf"^{name}\(incude=\.\.\.\): unknown argument \(did you mean 'include'\?\); "
        r"the arguments are .*types, include, exclude",
    ):
        make(incude="net.0")


@pytest.mark.parametrize(
    "make",
    [ActivationStatsTracker, ActivationShape, DeadUnitTracker, LayerTimer, SaturationTracker],
)
def test_a_statistic_selects_by_its_keywords(make: Any) -> None:
    stat = make(types=nn.Linear, include="net.*", exclude="net.4")
    assert [name for name, _ in stat.select(TinyMLP())] == ["net.0", "net.2"]


def test_state_keys_tell_configurations_apart() -> None:
    keys = {
        DeadReLUCallback().state_key,
        DeadReLUCallback(pre_activation="net.0").state_key,
        DeadReLUCallback(exclude="net.1").state_key,
        ActivationStatsCallback().state_key,
        ActivationStatsCallback(types=nn.Linear).state_key,
    }
    assert len(keys) == 5
    assert DeadReLUCallback(include="a").state_key == DeadReLUCallback(include=["a"]).state_key


def test_align_rows_puts_every_ranks_new_rows_in_one_order_with_their_values() -> None:
    """A rank's rows moved to the order every rank agrees on (the aligned rows, then each
    rank's new ones by rank), with what they measured; rows only another rank made start
    empty; per-unit states move with their rows."""
    from lightning_hooks.core.stats.dead_units import DeadUnitTracker

    stat = DeadUnitTracker(types=nn.ReLU)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 5), nn.ReLU())
    with stat.attach(model):
        model[3](torch.randn(6, 5).abs())  # this rank met "3" (5 units) first, then "1"
        model[1](-torch.ones(6, 3))
        stat.drain()  # what the hooks hold, into the states (before a read, as the base does)
        counts = {n: stat.counts[stat.unit_slice(i)].clone() for n, i in stat.rows.items()}
        assert stat.layers == ("3", "1") and stat.rows_grew
        other = [("1", 3), ("9", 2)]  # the other rank (rank 0): "1", then a layer only it ran
        stat.align_rows([other, stat.new_rows()])
        assert stat.layers == ("1", "9", "3") and not stat.rows_grew
        assert stat.units == [3, 2, 5]
        for name in ("1", "3"):
            torch.testing.assert_close(stat.counts[stat.unit_slice(stat.rows[name])], counts[name])
        assert not stat.counts[stat.unit_slice(1)].any()
        with pytest.raises(ValueError, match=r"layer '1' has 4 units on one rank and 3"):
            stat.align_rows([[("1", 4)], [("1", 3)]])


def test_align_rows_moves_what_the_hooks_still_hold_with_its_row() -> None:
    """Fired masks held for the end of the step (and the host call counts) are counted into the
    row they were seen for, also when the rows move before they are drained."""
    from lightning_hooks.core.stats.dead_units import DeadUnitTracker

    stat = DeadUnitTracker(types=nn.ReLU)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 5), nn.ReLU())
    x3, x1 = torch.randn(6, 5), torch.randn(6, 3)
    with stat.attach(model):
        model[3](x3)  # rows "3" then "1" on this rank; held, not yet counted
        model[1](x1)
        stat.align_rows([[("1", 3), ("9", 2)], stat.new_rows()])
        stat.drain()
        for name, x in (("3", x3), ("1", x1)):
            got = stat.counts[stat.unit_slice(stat.rows[name])]
            torch.testing.assert_close(got, (x > 0).sum(0).double())
            assert stat.calls[stat.rows[name]] == 1


def test_rows_the_ranks_cannot_align_disable_the_callback_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks, faked in one process: the other rank made ``net.1``'s row with 7 units. The
    same error on every rank (from what they exchanged) disables the callback everywhere at
    that logging step, one warning, and training goes on (strict mode raises it instead)."""
    import warnings

    from lightning_hooks.callbacks import attached, ranks
    from lightning_hooks.core.hooks.guard import STRICT_ENV
    from lightning_hooks.errors import LightningHooksWarning

    monkeypatch.setenv(STRICT_ENV, "0")
    monkeypatch.setattr(ranks, "world_size", lambda: 2)
    monkeypatch.setattr(ranks, "agree", lambda flags: [int(f) for f in flags])
    monkeypatch.setattr(attached, "gather_objects", lambda mine: [mine, [[("net.1", 7)]]])
    model = TinyMLP()
    callback = DeadReLUCallback(every_n_steps=1, warn_at=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, callbacks=[callback], max_epochs=2).fit(model)
    ours = [str(w.message) for w in caught if issubclass(w.category, LightningHooksWarning)]
    assert len(ours) == 1, ours
    assert "disabled on every rank from step 0" in ours[0]
    assert (
        "aligning rows across ranks: ValueError: DeadUnitTracker: layer 'net.1' has 16" in ours[0]
    )
    assert model.trainer.global_step == 8 and hooks_left(model) == []


def test_the_report_shows_a_user_statistic_as_a_column_of_its_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A statistic of the user's (tags ``family/stat/layer``) is a column of the report's table,
    beside the library's, with the value its last epoch logged."""
    from lightning_hooks.cli import main

    weight_peak: Any = runpy.run_path(str(EXAMPLE))["WeightPeak"]
    callbacks = [GradFlowCallback(), StatsCallback(weight_peak(), every_n_steps=2)]
    make_trainer(tmp_path, callbacks=callbacks).fit(TinyMLP())
    capsys.readouterr()
    assert main(["report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[1].split()
    assert header[:2] == ["layer", "grad_norm"] and header[-1] == "weights/peak"
    logged = dict(read_scalars(tmp_path)["weights/peak/net.2"])
    row = next(line.split() for line in lines[2:] if line.startswith("net.2 "))
    assert float(row[-1]) == pytest.approx(logged[max(logged)], rel=1e-2)  # shown to 3 digits
