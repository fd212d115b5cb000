"""The second label of ``benchmarks/divergence.py`` (a run is harmed when it ends worse than the
best run of its family), the precision it gives a rule set, the ground truth of a dead network
from recorded activations, and the outlier batches injected into healthy runs: on synthetic
loss curves and activations, and a few steps of real training."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from typing import Any

import numpy as np
import pytest

from conftest import load_benchmark


def _bench() -> Any:
    return load_benchmark("divergence")


def _curve(end: float, steps: int = 300) -> np.ndarray:
    """A loss that starts at ln 10 and sits at ``end`` from the next step on."""
    losses = np.full(steps, end)
    losses[0] = math.log(10)
    return losses


@pytest.mark.parametrize(
    ("best", "end", "hurt"),
    [
        (0.2, 0.25, False),  # best + 0.05 is the bar on a low loss
        (0.2, 0.26, True),
        (2.0, 2.2, False),  # 1.10 x best is the bar on a high one
        (2.0, 2.21, True),
        (0.2, math.nan, True),
        (0.2, math.inf, True),
    ],
)
def test_a_run_is_harmed_when_it_ends_worse_than_its_familys_best(
    best: float, end: float, hurt: bool
) -> None:
    assert _bench().harmed(_curve(end), best) is hurt


def test_the_end_is_the_mean_of_the_last_50_losses() -> None:
    losses = np.ones(300)
    losses[-50:] = 0.5
    losses[-51] = 100.0  # outside the tail
    assert _bench().end_loss(losses) == 0.5
    losses[-1] = math.nan
    assert _bench().end_loss(losses) == math.inf


def test_a_family_is_the_recipe_at_any_learning_rate_or_seed_without_the_event() -> None:
    bench = _bench()
    run = bench.Run("relu-mlp-digits", "adam", 1e-3)
    assert bench.recipe(run) == bench.recipe(replace(run, lr=1.0, seed=1))
    assert bench.recipe(run) != bench.recipe(replace(run, optimizer="sgd"))
    assert bench.recipe(run) != bench.recipe(replace(run, batch=4))
    twin = bench.Run("outlier-mlp-cancer", "adamw", 3e-4, batch=2, accum=4)
    odd = replace(twin, outlier_at=120, outlier=10.0)
    assert bench.recipe(odd) == bench.recipe(twin)
    assert bench.recipe(replace(twin, explode_at=37, explode=1e3)) == bench.recipe(twin)


def test_the_family_best_is_over_its_runs_only() -> None:
    bench = _bench()

    def trace(run: Any, end: float) -> dict[str, Any]:
        return {"run": asdict(run), "losses": _curve(end)}

    low = bench.Run("relu-mlp-digits", "adam", 1e-3)
    traces = [
        trace(low, 0.1),
        trace(replace(low, lr=1.0), math.nan),
        trace(replace(low, optimizer="sgd", lr=0.05), 0.3),
    ]
    best = bench.family_bests(traces)
    assert best[bench.recipe(low)] == pytest.approx(0.1)
    assert best[bench.recipe(replace(low, optimizer="sgd"))] == pytest.approx(0.3)


def test_precision_is_the_share_of_warned_runs_harmed_or_divergent() -> None:
    bench = _bench()

    def row(warned: bool, harmed: bool, diverges: int | None) -> dict[str, Any]:
        first = 5 if warned else None
        return {"first_warning": first, "harmed": harmed, "diverges_at": diverges}

    rows = [
        row(True, True, None),
        row(True, False, 10),
        row(True, False, None),  # false by both labels
        row(True, True, None),
        row(False, True, None),  # missed
        row(False, False, None),
    ]
    got = bench._label_totals(rows)
    assert got["warned"] == 4 and got["warned_bad"] == 3 and got["precision"] == 0.75
    # the old label calls healthy every warned run that did not diverge: 3 of them
    assert got["warned_old_healthy"] == 3 and got["warned_unharmed"] == 1
    assert got["bad"] == 4 and got["bad_warned"] == 3 and got["harmed"] == 3


def _activations(fired: np.ndarray, ran: np.ndarray | None = None) -> dict[str, Any]:
    return {
        "relus": [f"relu{i}" for i in range(fired.shape[1])],
        "fired": fired,
        "ran": np.ones_like(fired) if ran is None else ran,
    }


def test_a_network_dies_when_a_relu_layer_never_fires_again() -> None:
    death = _bench().death
    fired = np.ones((100, 2), dtype=bool)
    assert death(_activations(fired)) is None
    fired[40:, 1] = False
    fired[45, 1] = True  # fires once more: the silence to the end starts after it
    assert death(_activations(fired)) == (46, "relu1")
    fired[70:, 0] = False
    assert death(_activations(fired)) == (46, "relu1")  # the first layer to die
    fired[:, 0] = False
    assert death(_activations(fired)) == (0, "relu0")  # never fired


def test_a_short_silence_or_a_layer_without_input_is_not_death() -> None:
    death = _bench().death
    fired = np.ones((100, 2), dtype=bool)
    fired[91:, 0] = False  # 9 silent steps to the end: not enough
    assert death(_activations(fired)) is None
    fired = np.ones((100, 2), dtype=bool)
    ran = np.ones((100, 2), dtype=bool)
    fired[50:, 1] = False  # an unused branch: it does not run, so it cannot fire
    ran[50:, 1] = False
    assert death(_activations(fired, ran)) is None
    assert death({"losses": np.ones(100)}) is None  # no activations recorded


def test_a_message_names_the_learning_rate_only_with_its_value() -> None:
    quotes = _bench().quotes_lr
    assert quotes("the learning rate 0.3 killed layer 1", 0.3)
    assert quotes("at lr=1e-03, no unit fires", 1e-3)
    assert not quotes("lower the learning rate, add warm-up", 0.3)
    assert not quotes("loss diverging at optimizer step 10 (lower the learning rate)", 1.0)
    assert not quotes("learning rate 0.03 is fine", 0.3)


def test_the_outlier_step_reads_its_loss_scaled_and_the_rest_is_the_twin() -> None:
    """Five steps of the digits MLP: the outlier step's loss is 10x the twin's, the steps
    before it are the twin's exactly; shifted labels change that step's loss."""
    bench = _bench()
    twin = bench.Run("outlier-mlp-digits", "adam", 1e-3, steps=5)
    clean = bench.record(twin)["losses"]
    scaled = bench.record(replace(twin, outlier_at=2, outlier=10.0))["losses"]
    assert np.array_equal(scaled[:2], clean[:2])
    assert scaled[2] == pytest.approx(10.0 * clean[2], rel=1e-6)
    assert scaled[3] != clean[3]  # the scaled gradient stepped
    shifted = bench.record(replace(twin, outlier_at=2, shifted=2))["losses"]
    assert np.array_equal(shifted[:2], clean[:2]) and shifted[2] != clean[2]


def test_a_layer_without_a_gradient_is_recorded_unstepped_and_zeros_are_kept() -> None:
    """The unused branch gets no gradient from step 100 (out of the rules, as the callback
    leaves it); the mixture's idle experts get exactly 0, kept as 0 in the trace."""
    bench = _bench()
    branch = bench.record(bench.Run("branch-digits", "adam", 1e-3, steps=102))
    rows = [i for i, name in enumerate(branch["layers"]) if name.startswith("branch")]
    assert branch["stepped"][:100, rows].all() and not branch["stepped"][100:, rows].any()
    assert (branch["norms"][100:, rows] == 0).all()
    moe = bench.record(bench.Run("moe-digits", "adam", 1e-3, steps=110))
    assert "stepped" not in moe and (moe["norms"][100:, :-1] == 0).any()


def test_the_held_out_new_families_cover_every_model_data_set_and_optimizer() -> None:
    """Held out by family, never by seed: each half of the dead networks has both models, both
    data sets and both optimizers."""
    bench = _bench()
    runs = bench.new_runs()
    names = {bench.family(r) for r in runs}
    assert names > bench.NEW_HELD_OUT
    for half in ("tuning", "held_out"):
        dead = {bench.family(r) for r in runs if r.model in bench.DEAD_MODELS}
        side = [f for f in dead if bench.group(f) == half]
        assert len(side) == 4
        for part in ("mlp", "cnn", "digits", "cancer", "adam", "sgd"):
            assert any(part in f.split("-") for f in side), (half, part)


def test_the_second_fresh_half_is_new_families_on_their_own_side() -> None:
    """The second fresh half's families are reported in a half of their own, share no model
    with any other half, and each is swept on both seeds among the quick runs."""
    bench = _bench()
    fresh2 = bench.FRESH2_MODELS
    assert {bench.group(bench.family(r)) for r in bench.FRESH2_RUNS} == {"fresh2"}
    others = {r.model for r in bench.all_runs() if r.model not in fresh2}
    assert not fresh2 & others
    assert not fresh2 & (bench.HELD_OUT_FAMILIES | bench.NEW_HELD_OUT | bench.NEW_FRESH)
    quick = [r for r in bench.quick_runs() if r.model in fresh2]
    assert len(quick) == len(bench.NEW_SEEDS) * len(bench.FRESH2_RUNS)
    for model, spec in bench.FRESH2_LRS.items():
        assert len(spec.lrs) >= 5 and list(spec.lrs) == sorted(spec.lrs), model


@pytest.mark.parametrize(("name", "rows", "classes"), [("iris", 150, 3), ("diabetes", 442, 4)])
def test_the_second_fresh_halfs_data_sets_are_standardised_and_labelled(
    name: str, rows: int, classes: int
) -> None:
    """The iris set as it is and the diabetes set binned at its quartiles: standardised
    features, every class present, the diabetes classes near a quarter of the rows each."""
    bench = _bench()
    x, y = {"iris": bench._iris, "diabetes": bench._diabetes}[name]()
    assert x.shape[0] == rows == y.shape[0]
    assert np.allclose(x.mean(0).numpy(), 0.0, atol=1e-5)
    assert np.allclose(x.std(0).numpy(), 1.0, atol=1e-5)
    counts = np.bincount(y.numpy(), minlength=classes)
    assert len(counts) == classes and counts.min() >= rows // classes - 2


def test_the_warmup_schedule_ramps_then_holds() -> None:
    run = _bench().Run("fresh2-silu-iris", "adam", 0.3, "warmup")
    assert run.lr_at(0) == pytest.approx(0.3 / 30)
    assert run.lr_at(29) == pytest.approx(0.3)
    assert run.lr_at(30) == run.lr_at(299) == 0.3


def test_the_saved_label_tables_are_their_runs_recounted() -> None:
    """``benchmarks/results/divergence.json``: each rule set's precision per half is its first
    warnings on the saved runs (both labels) recounted; each half warns at least one run."""
    bench = _bench()
    saved = json.loads((bench.RESULTS / "divergence.json").read_text())
    runs = saved["label_runs"]
    for name, got in saved["labels"].items():
        rows = [
            {**r, "first_warning": first}
            for r, first in zip(runs, got["first_warning"], strict=True)
        ]
        assert got["halves"] == json.loads(json.dumps(bench.label_halves(rows))), name
    assert set(saved["new_held_out_families"]) == set(bench.NEW_HELD_OUT)
