"""Compare two log directories of the demo, run by run: what a change did to what is logged.

Every scalar (bit for bit; the layer times are wall-clock and left out), every histogram, every
text and the custom-scalars layout, and the image tags; tags only in the second directory are
listed unless named as expected. For the demo at two checkouts::

    PYTHONPATH=/path/to/old .venv/bin/python examples/demo.py --logdir /tmp/old
    .venv/bin/python examples/demo.py --logdir /tmp/new
    .venv/bin/python benchmarks/compare_runs.py /tmp/old /tmp/new --new activations/kurtosis
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TIMINGS = ("layer_time/",)


def _load(path: Path) -> Any:
    kinds = ("scalars", "histograms", "images", "tensors")
    accumulator = EventAccumulator(str(path), size_guidance=dict.fromkeys(kinds, 0))
    accumulator.Reload()
    return accumulator


def _same(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """The same steps and the same values, bit for bit (NaN equal to NaN)."""
    return len(a) == len(b) and all(
        x[0] == y[0] and (x[1] == y[1] or (math.isnan(x[1]) and math.isnan(y[1])))
        for x, y in zip(a, b, strict=True)
    )


def compare(old: Path, new: Path, expected: tuple[str, ...]) -> str:
    """One line for the run: what is equal, what differs, what is new or lost."""
    a, b = _load(old), _load(new)
    ta, tb = a.Tags(), b.Tags()
    shared = sorted(set(ta["scalars"]) & set(tb["scalars"]))
    values = timings = 0
    differ = []
    for tag in shared:
        va = [(e.step, e.value) for e in a.Scalars(tag)]
        vb = [(e.step, e.value) for e in b.Scalars(tag)]
        if tag.startswith(TIMINGS):
            timings += len(va)
            continue
        values += len(va)
        if not _same(va, vb):
            differ.append(tag)
    lost = sorted(set(ta["scalars"]) - set(tb["scalars"]))
    new_tags = sorted(set(tb["scalars"]) - set(ta["scalars"]))
    unexpected = [t for t in new_tags if not any(e in t for e in expected)]
    histograms = [
        t
        for t in ta["histograms"]
        if [(e.step, e.histogram_value) for e in a.Histograms(t)]
        != [(e.step, e.histogram_value) for e in b.Histograms(t)]
    ]
    texts = [
        t
        for t in ta["tensors"]
        if [e.tensor_proto.SerializeToString() for e in a.Tensors(t)]
        != [e.tensor_proto.SerializeToString() for e in b.Tensors(t)]
    ]
    images = sorted(set(ta["images"]) ^ set(tb["images"]))
    return (
        f"{values} scalar values in {len(shared)} shared tags, {len(differ)} tags differ "
        f"{differ[:5]}; {timings} timings left out; {len(lost)} tags lost {lost[:5]}; "
        f"{len(new_tags)} new, {len(unexpected)} unexpected {unexpected[:5]}; "
        f"{len(ta['histograms'])} histograms, {len(histograms)} differ; {len(ta['tensors'])} "
        f"texts and layouts, {len(texts)} differ {texts}; image tags that differ: {images}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--new", nargs="*", default=[], dest="expected", help="new tags' parts")
    parser.add_argument("--runs", nargs="*", default=["healthy", "broken"])
    args = parser.parse_args()
    for run in args.runs:
        old, new = (next((d / run).glob("version_*")) for d in (args.old, args.new))
        print(f"{run}: {compare(old, new, tuple(args.expected))}")


if __name__ == "__main__":
    main()
