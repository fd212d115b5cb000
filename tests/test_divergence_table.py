"""The divergence tables in docs/validation.md are the saved run of ``benchmarks/divergence.py``
(``benchmarks/results/divergence.json``), recounted from its runs, and that run used today's
defaults: change the rules or the tables, and this fails. The same for the small noisy runs'
counts in it (``benchmarks/noisy_runs.py``)."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from lightning_hooks import AlarmRules

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
RESULTS = json.loads((ROOT / "benchmarks" / "results" / "divergence.json").read_text())


HELD_OUT = frozenset(RESULTS["held_out_families"])
FRESH = frozenset(RESULTS["fresh_families"])


def _group(family: str) -> str:
    return "fresh" if family in FRESH else "held_out" if family in HELD_OUT else "tuning"


def _recount_explosions(rows: list[dict[str, Any]]) -> tuple[str, str]:
    """``damaging explosions warned at their step`` and ``harmless explosions warned`` cells."""
    hurt = [r for r in rows if r["damaging"]]
    harmless = [r for r in rows if not r["damaging"]]
    at_step = sum(r["warned_at_step"] for r in hurt)
    warned = sum(r["first_warning"] is not None for r in harmless)
    return f"{at_step} of {len(hurt)}", f"{warned} of {len(harmless)}"


def _confirmed(row: dict[str, Any]) -> bool:
    """Warned in time on confirmation: no later than 3 steps or 1% of the run (whichever is
    more) after the divergence step, and before the first non-finite loss."""
    first, at, nonfinite = row["first_warning"], row["diverges_at"], row["first_nonfinite"]
    allowance = max(3, math.ceil(0.01 * row["steps"]))
    return (
        first is not None and first <= at + allowance and (nonfinite is None or first <= nonfinite)
    )


def _recount(runs: list[dict[str, Any]]) -> tuple[str, str, str, str, str]:
    """``warned by the divergence step``, ``warned in time on confirmation``, its lag (median,
    worst), ``collapses warned in the first half`` and ``healthy warned`` cells, from the runs
    alone."""
    divergent = [r for r in runs if r["diverges_at"] is not None]
    healthy = [r for r in runs if r["diverges_at"] is None and not r["damaged"]]
    in_time = [
        r
        for r in divergent
        if r["first_warning"] is not None and r["first_warning"] <= r["diverges_at"]
    ]
    lags = [r["first_warning"] - r["diverges_at"] for r in divergent if _confirmed(r)]
    lag = f"{statistics.median(lags):g}, {max(lags)}" if lags else "-"
    warned = [r for r in healthy if r["first_warning"] is not None]
    collapses = [r for r in runs if r["kind"] == "attention" and r["damaged"]]
    early = [
        r
        for r in collapses
        if r["first_warning"] is not None and 2 * r["first_warning"] < r["steps"]
    ]
    return (
        f"{len(in_time)} of {len(divergent)}",
        f"{len(lags)} of {len(divergent)} | {lag}",
        f"{len(early)} of {len(collapses)}",
        f"{len(warned)} of {len(healthy)}",
        f"{sum(bool(r.get('setbacks')) for r in healthy)} of {len(healthy)}",
    )


def _row(rule_set: dict[str, Any], half: str | None) -> str:
    """The table row's cells of ``rule_set`` on one half (``tuning``, ``held_out``, ``fresh``;
    ``None``: every run)."""
    keep = (lambda r: True) if half is None else (lambda r: _group(r["family"]) == half)
    in_time, confirmed, collapses, healthy, _ = _recount([r for r in rule_set["runs"] if keep(r)])
    rows = [r for r in rule_set["explosions"]["runs"] if keep(r)]
    hurt, harmless = _recount_explosions(rows)
    return f"{in_time} | {confirmed} | {hurt} | {harmless} | {collapses} | {healthy}"


def _todays_rules() -> dict[str, object]:
    """Today's default rules; ``quiet_read`` says how a quiet step reads the norms, not which
    alarms fire (the runs are on the CPU, where every read is ``_foreach_norm``)."""
    return {k: v for k, v in dataclasses.asdict(AlarmRules()).items() if k != "quiet_read"}


def _saved_rules(saved: dict[str, object]) -> dict[str, object]:
    """A saved run's rules, ``every_n_steps`` (saved before it was renamed) read as
    ``evaluate_every_n_steps``: the same field, the same steps."""
    renamed = {"every_n_steps": "evaluate_every_n_steps"}
    return {renamed.get(k, k): v for k, v in saved.items() if k != "quiet_read"}


def test_the_saved_run_used_todays_defaults() -> None:
    assert _saved_rules(RESULTS["defaults"]) == _todays_rules()


def test_the_halves_are_split_by_family() -> None:
    """Every family is on one side: no run or explosion of a held-out family tunes; the fresh
    families are neither."""
    families = {r["family"] for r in RESULTS["rule_sets"]["lightning_hooks, defaults"]["runs"]}
    assert families > HELD_OUT | FRESH and len(HELD_OUT) >= len(families) / 3
    assert not HELD_OUT & FRESH and FRESH
    bench = load_benchmark("divergence")
    assert frozenset(bench.HELD_OUT_FAMILIES) == HELD_OUT
    assert frozenset(bench.FRESH_FAMILIES) == FRESH
    for run in bench.all_runs():  # the attention twins share their family
        twin = bench.twin_of(run)
        if twin is not None and twin[0] == "attention":
            assert bench.family(run) == bench.family(twin[1])


VALIDATION = (ROOT / "docs" / "validation.md").read_text()


def test_docs_table_rows_are_the_saved_runs_recounted() -> None:
    docs = VALIDATION
    for name, rule_set in RESULTS["rule_sets"].items():
        for half in ("tuning", "held_out", "fresh", None):
            assert f"| {name} | {_row(rule_set, half)} |" in docs, (name, half)


def test_every_explosion_has_its_twin_in_the_saved_run() -> None:
    """The ground truth of an explosion is its twin's loss: the twin (the same run without the
    event) is one of the saved runs, and a warning at the step comes no later than the step."""
    defaults = RESULTS["rule_sets"]["lightning_hooks, defaults"]
    names = {(r["run"], r["seed"]) for r in defaults["runs"]}
    rows = defaults["explosions"]["runs"]
    for row in rows:
        assert (row["run"].rsplit(", x", 1)[0], row["seed"]) in names, row["run"]
        if row["warned_at_step"]:
            assert row["first_warning"] is not None and row["first_warning"] <= row["at"]
    assert {r["at"] for r in rows} == {37, 150}


def _held_out_cells(name: str, half: str = "held_out") -> list[str]:
    return _row(RESULTS["rule_sets"][name], half).split(" | ")


def test_the_docs_quote_what_waiting_for_a_rise_costs() -> None:
    """The lead that confirming a setback gives up against warning it at once, and the
    setbacks logged on healthy runs, per half, as counted."""
    for half, c in RESULTS["changes"].items():
        cells = [c["timely_before"], c["lead_lost_median"], c["lead_lost_worst"], c["late_now"]]
        cells += [c["healthy_setbacks"], c["setbacks_warned_at_once"]]
        cells += [c["setbacks_warned"]]
        row = " | ".join("-" if v is None else f"{v:g}" for v in cells)
        assert f" | {row} |" in VALIDATION, half


def _count(cell: str) -> int:
    """The count of an ``N of M`` cell."""
    return int(cell.split(" of ", maxsplit=1)[0])


def _unseen(name: str) -> list[int]:
    """Divergent warned in time on confirmation, divergent, healthy warned, healthy: held-out
    and fresh."""
    cells = [_held_out_cells(name, half) for half in ("held_out", "fresh")]
    pairs = [(c[1].split(" of "), c[-1].split(" of ")) for c in cells]
    return [sum(int(p[i][j]) for p in pairs) for i in (0, 1) for j in (0, 1)]


def test_the_defaults_warn_fewer_healthy_runs_than_every_useful_peer() -> None:
    """On the families the defaults were not tuned on (held out and fresh): every peer that
    warns at least half the divergent runs in time warns more healthy runs."""
    _, divergent, healthy, _ = _unseen("lightning_hooks, defaults")
    peers = [n for n in RESULTS["rule_sets"] if not n.startswith("lightning_hooks")]
    assert len(peers) == 5
    for name in peers:
        in_time, _, warned, _ = _unseen(name)
        if 2 * in_time >= divergent:
            assert warned > healthy, name


NOISY = json.loads((ROOT / "benchmarks" / "results" / "noisy_runs.json").read_text())


def test_the_readme_quotes_the_saved_run() -> None:
    """The README's alarm figures are the held-out half of the saved run."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    held = RESULTS["rule_sets"]["lightning_hooks, defaults"]["halves"]["held_out"]
    quote = (
        f"warn in time on confirmation in {held['warned_confirmed']} of {held['divergent']} "
        f"real divergent runs, on {held['healthy_warned']} of {held['healthy']} healthy ones"
    )
    assert quote in readme, quote
    families = {"ft-mix-mb1", "ft-mix-accum", "ft-gru-mix", "wine-sgd", "wine-adam"}
    runs = RESULTS["rule_sets"]["lightning_hooks, defaults"]["runs"]
    healthy = [r for r in runs if r["family"] in families and r["diverges_at"] is None]
    warned = sum(r["first_warning"] is not None for r in healthy)
    quote = f"({warned} of {len(healthy)} healthy runs of those families)"
    assert quote in readme, quote


def test_healthy_runs_with_a_setback_are_counted_from_the_runs() -> None:
    """The setbacks logged on healthy runs, quoted per half in the docs, recounted."""
    defaults = RESULTS["rule_sets"]["lightning_hooks, defaults"]
    for half in ("tuning", "held_out", "fresh"):
        runs = [r for r in defaults["runs"] if _group(r["family"]) == half]
        cell = _recount(runs)[-1]
        assert f"Healthy runs with a setback logged (defaults): {cell}." in " ".join(
            VALIDATION.split()
        ), half


def test_the_noisy_runs_in_the_docs_are_the_saved_run_with_todays_defaults() -> None:
    assert _saved_rules(NOISY["defaults"]) == _todays_rules()
    docs = " ".join(VALIDATION.split())
    warned, runs = NOISY["warned_seeds"], NOISY["runs"]
    fit, plain, tiny = runs.values()
    for rules, quote in (
        (
            "with the noise bar (defaults)",
            "At the defaults: **{} of {}, {} of {} and {} of {} seeds",
        ),
        (
            "without (diverge_noise=0)",
            "Without the noise bar (`diverge_noise=0`): {} of {}, {} of {} and {} of {}",
        ),
    ):
        counts = [len(warned[kind][rules]) for kind in runs]
        cells = [v for pair in zip(counts, (fit, plain, tiny), strict=True) for v in pair]
        assert quote.format(*cells) in docs, quote
    assert (
        NOISY["warned_live"]
        == warned["quickstart through Trainer.fit"]["with the noise bar (defaults)"]
    )


def _benchmark() -> Any:
    return load_benchmark("divergence")


def test_an_explosion_is_damaging_in_the_scale_of_its_loss() -> None:
    """The margin of "clearly worse" is a share of the twin's first loss: a loss 4x its twin's
    is damage on a 2-class task that has learnt down to 0.01, and 0.04 above 1.25x the twin's is
    noise on a 10-class loss that starts at ln 10."""
    damaging = _benchmark().damaging

    def trace(first: float, after: float, explode_at: int | None) -> dict[str, Any]:
        losses = np.full(300, after)
        losses[0] = first
        return {"run": {"explode_at": explode_at}, "losses": losses}

    two, ten = math.log(2), math.log(10)
    assert damaging(trace(two, 0.04, 37), trace(two, 0.01, None))
    assert not damaging(trace(two, 0.02, 37), trace(two, 0.01, None))
    assert not damaging(trace(ten, 0.5 * 1.25 + 0.04, 37), trace(ten, 0.5, None))
    assert damaging(trace(ten, 0.5 * 1.25 + 0.05, 37), trace(ten, 0.5, None))
    assert damaging(trace(ten, math.nan, 37), trace(ten, 0.5, None))


def test_the_docs_frontier_is_the_saved_frontier_and_agrees_with_the_main_table() -> None:
    """``divergence_frontier.py``'s saved table is quoted whole in the validation page; its
    defaults row is the main table's defaults recounted, and the ground truth's own test,
    blind to the end, warns every divergent run in time."""
    saved = ROOT / "benchmarks" / "results" / "divergence_frontier"
    frontier = json.loads(saved.with_suffix(".json").read_text())
    assert _saved_rules(frontier["defaults"]) == _todays_rules()
    table = [line for line in saved.with_suffix(".md").read_text().splitlines() if "|" in line]
    assert len(table) == 2 + len(frontier["rule_sets"])
    assert all(line in VALIDATION for line in table)
    rows = frontier["rule_sets"]
    for half in ("tuning", "held_out", "fresh"):
        main = _held_out_cells("lightning_hooks, defaults", half)
        got = rows["defaults (diverge_patience=3, diverge_span=4)"][half]
        assert f"{got['warned_in_time']} of {got['divergent']}" == main[0], half
        assert f"{got['healthy_warned']} of {got['healthy']}" == main[-1], half
        truth = rows["the ground truth's test, blind to the end"][half]
        assert truth["warned_in_time"] == truth["divergent"], half
