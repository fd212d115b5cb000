"""docs/architecture.md quotes the recording of ``benchmarks/walks.py`` (saved in
``benchmarks/results/walks.md``): what ``GradFlowCallback()`` holds, and where one gradient norm
and one ``diverging`` alarm go through the library's files. Change the path of a value, or what
the callback holds, and this fails until the recording is made again::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/walks.py --save
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from lightning_hooks import internals

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("composition", "walks")
AGAIN = "PYTHONPATH=$PWD .venv/bin/python benchmarks/walks.py --save"


def _without_lines(text: str) -> str:
    """``text`` without the line numbers of the calls that make returns (an edit above them
    moves them, not the walk), nor the counts of the whole recording (every call into the
    library: a first use's imports, done once in a process, count there)."""
    text = re.sub(r"\.py:\d+`", ".py`", text)
    return re.sub(r"one value: \d+ files, \d+ returns", "one value: N files, N returns", text)


@pytest.fixture(scope="module")
def walks() -> Any:
    return load_benchmark("walks")


@pytest.mark.parametrize("part", PARTS)
def test_the_page_quotes_the_saved_recording(walks: Any, part: str) -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    saved = (ROOT / "benchmarks" / "results" / "walks.md").read_text()
    assert walks.recorded_part(page, part) == walks.recorded_part(saved, part), AGAIN


@pytest.mark.skipif(
    not internals.speedups(),
    reason="recorded with the speed-ups on (off, the value goes to the logger's log_metrics)",
)
def test_the_saved_recording_is_todays(walks: Any) -> None:
    saved = (ROOT / "benchmarks" / "results" / "walks.md").read_text()
    recorded = walks.record()
    for part in PARTS:
        today = _without_lines(recorded[part])
        assert today == _without_lines(walks.recorded_part(saved, part)), AGAIN


def test_a_walk_starts_where_the_value_is_read_and_ends_where_it_is_handed_on(
    walks: Any,
) -> None:
    """The gradient norm's walk starts in the callback's optimizer-step hook (the guard around
    it first) and ends at TensorBoard's writer; the alarm's ends at Lightning's warning."""
    saved = walks.recorded_part((ROOT / "benchmarks" / "results" / "walks.md").read_text(), "walks")
    sections = saved.split("### ")[1:]
    assert [s.split(":")[0] for s in sections] == [
        "`grad_flow/grad_norm_step/net.0`",
        "`grad_flow/grad_norm/net.0`",
        "`diverging`",
    ]
    for section in sections[:2]:
        steps = [line for line in section.splitlines() if re.match(r"\d+\. ", line)]
        assert "GradFlowCallback.on_before_optimizer_step" in steps[1]
        assert "torch/utils/tensorboard/writer.py" in steps[-1]
    steps = [line for line in sections[2].splitlines() if re.match(r"\d+\. ", line)]
    assert "lightning_utilities" in steps[-1]
