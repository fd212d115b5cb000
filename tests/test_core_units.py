"""Direct checks of three core parts, without a Trainer: which gradient-flow rows are logged past
the cap, the alarms' ring buffer of norms as it wraps, and an optimizer's view of the layout as
its param_groups change."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lightning_hooks.core.alarms.training_alarms import NormRing
from lightning_hooks.core.ops.grad_stats import ParamLayout
from lightning_hooks.core.stats.accumulator import LayerTable
from lightning_hooks.core.stats.grad_flow import GRAD_FLOW_STATS, logged_rows
from lightning_hooks.core.stats.optimizer_view import OptimizerViews

# ---------------------------------------------------------------------------------------------
# logged_rows
# ---------------------------------------------------------------------------------------------

_NORM = GRAD_FLOW_STATS.index("grad_norm")
_NONFINITE = GRAD_FLOW_STATS.index("grad_nonfinite")


def _table(norms: list[float | None], nonfinite: list[float] | None = None) -> LayerTable:
    """A gradient-flow table of ``len(norms)`` layers and the global row.

    ``None`` in ``norms`` is a layer that got no gradient (never measured); ``nonfinite`` is each
    layer's total count of non-finite gradient entries (default: none).
    """
    rows = len(norms) + 1
    width = len(GRAD_FLOW_STATS)
    count = np.zeros((rows, width))
    mean = np.full((rows, width), np.nan)
    total = np.zeros((rows, width))
    bad = nonfinite if nonfinite is not None else [0.0] * len(norms)
    for row, norm in enumerate(norms):
        if norm is None:
            continue
        count[row, [_NORM, _NONFINITE]] = 1.0
        mean[row, _NORM] = norm
        total[row, _NORM] = norm
        mean[row, _NONFINITE] = bad[row]
        total[row, _NONFINITE] = bad[row]
    count[-1, [_NORM, _NONFINITE]] = 1.0
    mean[-1, _NORM] = 1.0
    layers = (*[f"layer{i}" for i in range(len(norms))], "global")
    return LayerTable(
        layers=layers, stats=GRAD_FLOW_STATS, mean=mean, peak=mean.copy(), total=total, count=count
    )


def _expected_rows(
    norms: list[float | None], nonfinite: list[float], max_layers: int
) -> tuple[set[int], set[int], int]:
    """What the docstring promises, worked out by hand: the bad rows that must be kept, the
    other rows allowed (the largest and smallest norms), and how many rows are returned.

    A bad row is a measured one with a non-finite norm or a non-finite entry counted. Of the
    places left after the bad rows, the larger half (an odd place included) goes to the largest
    finite norms, the rest to the smallest.
    """
    measured = [i for i, n in enumerate(norms) if n is not None]
    bad = [i for i in measured if nonfinite[i] > 0 or not np.isfinite(norms[i])]
    others = sorted((i for i in measured if i not in bad), key=lambda i: norms[i])
    kept_bad = min(len(bad), max_layers)
    places = max_layers - kept_bad
    largest = (places + 1) // 2
    smallest = places - largest
    chosen = set(others[:smallest])
    if largest:
        chosen |= set(others[-largest:])
    return set(bad), chosen, kept_bad + len(chosen)


def test_every_row_is_logged_within_the_cap() -> None:
    """Without a cap, or with no more layers than it, every layer row is logged, in order, and
    the global row is not among them."""
    stats = _table([3.0, 1.0, 2.0])
    assert logged_rows(stats, None) == [0, 1, 2]
    assert logged_rows(stats, 3) == [0, 1, 2]
    assert logged_rows(stats, 10) == [0, 1, 2]


def test_past_the_cap_half_go_to_the_largest_and_half_to_the_smallest() -> None:
    """Past the cap, an even cap is split evenly between the largest and the smallest gradient
    norms; the rows come back in ascending order."""
    norms: list[float | None] = [5.0, 0.1, 9.0, 3.0, 0.3, 7.0, 4.0, 8.0, 0.2, 6.0]
    rows = logged_rows(_table(norms), 4)
    assert rows == sorted(rows)
    assert rows == [1, 2, 7, 8]  # 0.1 and 0.2, then 8.0 and 9.0


def test_an_odd_place_goes_to_the_largest() -> None:
    """With an odd cap, the odd place goes to the largest norms: three largest, two smallest."""
    norms: list[float | None] = [5.0, 0.1, 9.0, 3.0, 0.3, 7.0, 4.0, 8.0, 0.2, 6.0]
    assert logged_rows(_table(norms), 5) == [1, 2, 5, 7, 8]  # 0.1, 0.2 and 7.0, 8.0, 9.0
    assert logged_rows(_table(norms), 1) == [2]  # the one place: the largest norm


def test_rows_with_non_finite_values_are_always_kept() -> None:
    """A measured row with a non-finite norm (inf or NaN), or with non-finite gradient entries
    counted, is kept ahead of the norms; the places left are split as usual."""
    norms: list[float | None] = [1.0, float("inf"), 2.0, 3.0, float("nan"), 4.0, 5.0, 6.0]
    nonfinite = [0.0, 1.0, 0.0, 0.0, 1.0, 0.0, 2.0, 0.0]  # row 6: entries lost, norm finite
    # three bad rows and two places: the largest good norm (row 7) and the smallest (row 0).
    assert logged_rows(_table(norms, nonfinite), 5) == [0, 1, 4, 6, 7]
    # one place left: it goes to the largest.
    assert logged_rows(_table(norms, nonfinite), 4) == [1, 4, 6, 7]


def test_bad_rows_beyond_the_cap_fill_it_alone() -> None:
    """With more bad rows than the cap, the cap is filled with bad rows only."""
    norms: list[float | None] = [float("nan"), 1.0, float("inf"), 2.0, float("nan"), 3.0]
    rows = logged_rows(_table(norms), 2)
    assert len(rows) == 2
    assert set(rows) <= {0, 2, 4}


def test_a_layer_with_no_gradient_takes_no_place() -> None:
    """A layer never measured is not logged past the cap, and the places go to measured
    layers; with fewer measured layers than the cap, all of them are logged."""
    norms: list[float | None] = [None, 4.0, None, 1.0, 3.0, None, 2.0, 5.0]
    assert logged_rows(_table(norms), 4) == [1, 3, 6, 7]  # 1.0, 2.0 and 4.0, 5.0
    assert logged_rows(_table([None, 1.0, None, 2.0, None]), 3) == [1, 3]


@pytest.mark.parametrize("seed", range(40))
def test_the_rows_logged_match_an_independent_choice(seed: int) -> None:
    """Over random tables (unmeasured and bad rows included), the rows logged are at most the
    cap, never an unmeasured one, keep every bad row the cap has room for, and fill the rest
    with the largest and smallest norms in the promised split."""
    rng = np.random.default_rng(seed)
    num_layers = int(rng.integers(2, 30))
    max_layers = int(rng.integers(0, num_layers))  # always past the cap
    norms: list[float | None] = []
    nonfinite = []
    for value in rng.permutation(num_layers) + rng.random(num_layers):
        kind = rng.random()
        if kind < 0.15:
            norms.append(None)
        elif kind < 0.25:
            norms.append(float(rng.choice([np.inf, np.nan])))
        else:
            norms.append(float(value))
        nonfinite.append(1.0 if rng.random() < 0.1 else 0.0)
    expected = _expected_rows(norms, nonfinite, max_layers)
    bad = expected[0]
    chosen = expected[1]
    size = expected[2]
    rows = logged_rows(_table(norms, nonfinite), max_layers)
    assert rows == sorted(set(rows))
    assert len(rows) == size
    assert len(rows) <= max_layers
    assert all(norms[i] is not None for i in rows)
    assert len(bad & set(rows)) == min(len(bad), max_layers)
    assert set(rows) - bad == chosen


# ---------------------------------------------------------------------------------------------
# NormRing
# ---------------------------------------------------------------------------------------------


def _traced(step: int, rows: int) -> np.ndarray:
    """A step's ``[3, rows]``, distinct per step and exact in float32."""
    return (step * 100 + np.arange(3 * rows, dtype=np.float32)).reshape(3, rows)


def _window(written: list[int], step: int, size: int) -> list[int]:
    """The written steps the ring keeps up to ``step``: those of the last ``size`` steps,
    oldest first."""
    return sorted(s for s in written if step - size < s <= step)


def test_the_ring_returns_the_last_steps_in_order_after_wrapping() -> None:
    """After more steps than its size, the ring returns the last ``size`` steps, oldest first,
    each with the rows written for it."""
    size = 4
    rows = 3
    ring = NormRing(size, rows)
    written = list(range(11))
    for step in written:
        ring.write(step, _traced(step, rows))
    history = ring.read(10)
    assert history.steps == [7, 8, 9, 10]
    assert history.steps == written[-size:]
    np.testing.assert_array_equal(
        history.traced, np.stack([_traced(s, rows) for s in [7, 8, 9, 10]])
    )


def test_reading_an_earlier_step_keeps_to_its_window() -> None:
    """Read at an earlier step, the ring returns only the steps up to it that it still holds,
    oldest first; before wrapping it returns every step written."""
    size = 4
    rows = 2
    ring = NormRing(size, rows)
    for step in range(3):
        ring.write(step, _traced(step, rows))
    assert ring.read(2).steps == [0, 1, 2]
    assert ring.read(1).steps == [0, 1]
    for step in range(3, 11):
        ring.write(step, _traced(step, rows))
    history = ring.read(8)  # 5 and 6 are overwritten by 9 and 10
    assert history.steps == [7, 8]
    np.testing.assert_array_equal(history.traced, np.stack([_traced(s, rows) for s in [7, 8]]))


@pytest.mark.parametrize("every", [1, 2, 3, 5])
@pytest.mark.parametrize("size", [1, 3, 4, 7])
def test_the_ring_keeps_the_last_size_steps_when_writes_skip_steps(every: int, size: int) -> None:
    """Written every few steps over many wraps, each read returns exactly the written steps of
    the last ``size`` steps, oldest first, with their rows."""
    rows = 2
    ring = NormRing(size, rows)
    written = []
    for step in range(0, 40, every):
        ring.write(step, _traced(step, rows))
        written.append(step)
        history = ring.read(step)
        expected = _window(written, step, size)
        assert history.steps == expected
        want = np.stack([_traced(s, rows) for s in expected])
        np.testing.assert_array_equal(history.traced, want)


def test_the_ring_survives_a_checkpoint_after_wrapping() -> None:
    """A ring loaded from another's state after wrapping reads the same steps and rows; a state
    of another size leaves the ring empty."""
    size = 4
    rows = 2
    ring = NormRing(size, rows)
    for step in range(9):
        ring.write(step, _traced(step, rows))
    loaded = NormRing(size, rows)
    loaded.load_state_dict(ring.state_dict())
    history = loaded.read(8)
    assert history.steps == [5, 6, 7, 8]
    np.testing.assert_array_equal(history.traced, ring.read(8).traced)
    other = NormRing(size + 1, rows)
    other.load_state_dict(ring.state_dict())
    assert other.read(8).steps == []


# ---------------------------------------------------------------------------------------------
# OptimizerViews
# ---------------------------------------------------------------------------------------------


def _net() -> nn.Sequential:
    """Three linear layers (9, 16 and 5 entries), as the tracker lays out named children."""
    return nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))


def _ids(params: tuple[nn.Parameter, ...] | list[nn.Parameter]) -> list[int]:
    return [id(p) for p in params]


def test_a_new_param_group_rebuilds_the_view() -> None:
    """After ``add_param_group``, the optimizer's view is built anew: it holds the new group's
    parameters in the layout's order, their layers' rows and sizes, and the generation moves."""
    net = _net()
    layout = ParamLayout.from_modules(list(net.named_children()))
    assert layout.layers == ("0", "2", "4")
    opt = torch.optim.SGD(net[0].parameters(), lr=0.1)
    views = OptimizerViews(layout)
    first = views.view(opt)
    assert views.view(opt) is first  # unchanged groups: the same view
    assert _ids(first.params) == _ids(list(net[0].parameters()))
    assert first.row_ids == (0, 3)
    assert not first.every_row
    generation = views.generation

    opt.add_param_group({"params": list(net[4].parameters())})
    assert views.current(opt) is None
    assert views.generation > generation
    second = views.view(opt)
    assert second is not first
    assert views.built[id(opt)] is second
    expected = [
        p for p in layout.params if any(p is q for g in opt.param_groups for q in g["params"])
    ]
    assert _ids(second.params) == _ids(expected)
    assert _ids(second.params) == _ids([*net[0].parameters(), *net[4].parameters()])
    assert second.row_ids == (0, 2, 3)
    assert second.key == (2, 2)
    assert second.index.tolist() == [0, 0, 1, 1]
    assert second.numel.tolist() == [9.0, 5.0, 14.0]
    assert views.layers(opt) == frozenset({0, 2})
    assert views.unstepped([opt]) == ("2",)

    opt.add_param_group({"params": list(net[2].parameters())})
    third = views.view(opt)
    assert third is not second
    assert _ids(third.params) == _ids(layout.params)  # the layout's order, not the groups'
    assert third.every_row
    assert third.cells == slice(None)
    assert third.numel.tolist() == [9.0, 16.0, 5.0, 30.0]
    assert views.unstepped([opt]) == ()


def test_clear_drops_the_views_and_counts_an_unfrozen_parameter() -> None:
    """``clear`` forgets every built view and moves the generation; the next view is built
    anew, and a parameter unfrozen by ``requires_grad`` alone counts from there, not before."""
    net = _net()
    for p in net[2].parameters():
        p.requires_grad_(False)
    layout = ParamLayout.from_modules(list(net.named_children()))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    views = OptimizerViews(layout)
    first = views.view(opt)
    assert _ids(first.params) == _ids([*net[0].parameters(), *net[4].parameters()])
    for p in net[2].parameters():
        p.requires_grad_(True)
    assert views.view(opt) is first  # the groups did not change: still the built view
    generation = views.generation

    views.clear()
    assert views.built == {}
    assert views.current(opt) is None
    assert views.generation > generation
    rebuilt = views.view(opt)
    assert rebuilt is not first
    assert _ids(rebuilt.params) == _ids(layout.params)
    assert rebuilt.every_row
