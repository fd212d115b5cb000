"""``benchmarks/overhead.py`` writes the tracked results only when asked (``--save``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _overhead() -> ModuleType:
    spec = importlib.util.spec_from_file_location("overhead", ROOT / "benchmarks" / "overhead.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["overhead"] = module
    spec.loader.exec_module(module)
    return module


def test_results_are_written_only_with_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    overhead = _overhead()
    assert not overhead.parse_args(["--quick"]).save
    assert overhead.parse_args([]).out == str(ROOT / "benchmarks" / "results" / "overhead")
    monkeypatch.setattr(overhead, "markdown", lambda results: "| table |\n")
    monkeypatch.setattr(overhead, "time_rounds", lambda *a: {})
    monkeypatch.setattr(overhead, "measures", lambda *a: {})
    out = tmp_path / "results" / "overhead"
    overhead.main(["--models", "mlp", "--depths", "--sample-every", "--out", str(out)])
    assert not out.parent.exists()
    assert "not saved: add --save" in capsys.readouterr().err
    overhead.main(["--models", "mlp", "--depths", "--sample-every", "--out", str(out), "--save"])
    assert out.with_suffix(".md").read_text() == "| table |\n"
    assert '"command"' in out.with_suffix(".json").read_text()


@pytest.mark.parametrize(("players", "turn"), [(2, 1), (3, 2), (4, 5)])
def test_the_paired_ring_runs_one_turn_at_a_time_in_order_and_ends(players: int, turn: int) -> None:
    """``benchmarks/paired.py``'s baton: each player runs ``turn`` steps while the others wait,
    around the ring in order, and every player finishes (no one is left waiting)."""
    import threading
    import time

    paired = load_benchmark("paired")
    steps = 3 * turn + 1  # a last, short turn too
    batons = [threading.Semaphore(1 if i == 0 else 0) for i in range(players)]
    log: list[int] = []
    running: list[int] = []

    overlaps: list[list[int]] = []

    def play(i: int) -> None:
        baton = paired.Baton(batons[i], batons[(i + 1) % players], turn)
        for _ in range(steps):
            baton.on_train_batch_start()
            running.append(i)
            log.append(i)
            time.sleep(0.002)  # a step: the others get the interpreter meanwhile
            if running != [i]:  # somebody else ran inside this player's turn
                overlaps.append(list(running))
            running.remove(i)
        baton.on_train_end()
        counts.append(len(baton.cpu))

    counts: list[int] = []
    threads = [threading.Thread(target=play, args=(i,), daemon=True) for i in range(players)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert not overlaps
    assert counts == [steps] * players  # a step start timed per step
    expected = [
        i
        for start in range(0, steps, turn)
        for i in range(players)
        for _ in range(min(turn, steps - start))
    ]
    assert log == expected


def test_paired_ratios_are_to_bare_in_the_same_round_over_steps_that_followed_their_own() -> None:
    paired = load_benchmark("paired")
    rounds = [  # turns of 3: steps 0 and 3 began a turn (the 9s: after another process's)
        {"bare": [9.0, 1.0, 1.0, 9.0, 1.0, 2.0], "x": [9.0, 1.1, 1.1, 9.0, 1.1, 4.0]},
        {"bare": [9.0, 2.0, 2.0, 9.0, 2.0, 4.0], "x": [9.0, 2.4, 2.4, 9.0, 2.4, 8.0]},
    ]
    assert paired.own_steps(rounds[0]["x"], warmup=1, turn=3) == [1.1, 1.1, 1.1, 4.0]
    rows = paired.summarize(rounds, warmup=1, turn=3)
    assert rows["x"]["rounds"]["quiet"] == pytest.approx([1.1, 1.2])  # the median steps
    assert rows["x"]["rounds"]["mean"] == pytest.approx([7.3 / 5, 15.2 / 10])  # logging steps in it
    assert rows["x"]["quiet"]["median"] == pytest.approx(1.15)
    assert rows["bare"]["mean"] == {"median": 1.0, "min": 1.0, "max": 1.0}
