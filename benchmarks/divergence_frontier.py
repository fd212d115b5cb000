"""What telling a setback from a divergence costs: *diverging* at several patiences and spans,
and the ground truth's own test applied as the run goes, replayed on ``divergence.py``'s traces.

A run is divergent or healthy by how it ends (``divergence.divergence_step``): the same rise
of the loss is a divergence in a run that never recovers and a setback in one that does. The
last row applies the ground truth's test at each step without knowing the end: it warns every
divergent run at its divergence step, and the healthy runs it warns are the setbacks that the
loss alone cannot tell apart in time. Each row gives, per half, the divergent runs warned in
time, the median lead (steps) and the healthy runs warned (by any rule that warns, for ours).

Usage::

    PYTHONPATH=$PWD python benchmarks/divergence_frontier.py   # after divergence.py recorded
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from divergence import (
    HALVES,
    _cells,
    _first_divergence,
    _subset,
    all_traces,
    group,
    ours,
    result_header,
    score,
)

from lightning_hooks.core import AlarmRules


def ground_truth_online(trace: dict[str, Any]) -> list[int]:
    """The ground truth's test at each step, blind to how the run ends: its first step."""
    step = _first_divergence(trace["losses"])
    return [] if step is None else [step]


RULE_SETS: dict[str, Callable[[dict[str, Any]], list[int]]] = {
    "defaults (diverge_patience=3, diverge_span=4)": ours(AlarmRules()),
    **{f"diverge_patience={p}": ours(AlarmRules(diverge_patience=p)) for p in (1, 2, 5)},
    "diverge_span=8": ours(AlarmRules(diverge_span=8)),
    "the ground truth's test, blind to the end": ground_truth_online,
}


def main(argv: list[str] | None = None) -> None:
    args, traces, started, recorded = all_traces("divergence_frontier", argv, __doc__)
    rows = {}
    for name, replay in RULE_SETS.items():
        result = score(traces, replay)
        rows[name] = {
            half: _subset(result, lambda r, h=half: group(r["family"]) == h) for half in HALVES
        }
        print(f"replayed {name}", file=sys.stderr)
    out = {**result_header("divergence_frontier", argv, started, recorded), "rule_sets": rows}
    header = "| rule set | " + " | ".join(
        f"{half.replace('_', '-')}: divergent warned in time | median lead | healthy warned"
        for half in HALVES
    )
    lines = [header + " |", "| --- " * (1 + 3 * len(HALVES)) + "|"]
    lines += [
        f"| {name} | " + " | ".join(_cells(r[half]) for half in HALVES) + " |"
        for name, r in rows.items()
    ]
    target = Path(args.out)
    target.with_suffix(".json").write_text(json.dumps(out, indent=2) + "\n")
    summary = (__doc__ or "").split("\n\n")[0]
    target.with_suffix(".md").write_text(summary + "\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
