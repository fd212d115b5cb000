"""docs/validation.md's tables of injected faults and healthy runs are
benchmarks/results/alarms.json: re-running ``benchmarks/alarms.py`` and not updating the page
fails."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rows(text: str, header: str) -> dict[str, list[str]]:
    """The rows of the table under ``header``: first cell -> the others."""
    lines = text[text.index(header) :].splitlines()
    rows = {}
    for line in lines[2:]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        rows[cells[0]] = cells[1:]
    return rows


def _detection(found: str) -> str:
    """``37 (explosion net.2, spike net.2)`` as the page writes it."""
    match = re.fullmatch(r"(\d+) \((.*)\)", found)
    if match is None:
        return found
    alarms = "; ".join(a.replace(" ", ", ", 1) for a in match.group(2).split(", "))
    return f"step {match.group(1)} ({alarms})"


def test_the_alarms_page_is_the_saved_benchmark_run() -> None:
    saved = json.loads((ROOT / "benchmarks/results/alarms.json").read_text())
    page = (ROOT / "docs/validation.md").read_text()
    healthy = _rows(page, "| healthy run | worst norm / scale |")
    assert healthy == {
        run: [
            f"{max(saved['worst_ratio_to_scale'][run]):.2f}x",
            str(counts["defaults"]),
            str(counts["spike_factor=5"]),
        ]
        for run, counts in saved["false_alarms"].items()
    }
    detection = _rows(page, "| fault | first alarm (rule, layer) |")
    assert detection == {
        fault: [_detection(found["defaults"])] for fault, found in saved["detection"].items()
    }
