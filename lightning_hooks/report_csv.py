"""Reading a ``CSVLogger`` run back for the report: ``metrics.csv`` as the scalar series
TensorBoard would hold (no heavy imports: the CLI answers fast)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

__all__ = ["METRICS_FILE", "csv_series"]

METRICS_FILE = "metrics.csv"
"""The file a ``CSVLogger`` writes its scalars to, in its ``log_dir``."""


def csv_series(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar column of a ``metrics.csv`` as ``[(step, value)]`` per tag, in row order.

    A blank cell (the tag was not logged in that row) is skipped; as TensorBoard does, a step
    lower than the tag's last one (a run resumed from a checkpoint) drops the tag's values from
    that step on.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "metrics.csv"
        >>> _ = path.write_text("a/b/c,step\\n1.5,0\\n,1\\n2.5,2\\n")
        >>> csv_series(path)
        {'a/b/c': [(0, 1.5), (2, 2.5)]}
    """
    series: dict[str, list[tuple[int, float]]] = {}
    with path.open(newline="", encoding="utf-8") as file:
        for row in csv.DictReader(file):
            step = int(float(row.get("step") or 0))
            for tag, cell in row.items():
                if tag == "step" or not cell:
                    continue
                values = series.setdefault(tag, [])
                if values and step < values[-1][0]:
                    values[:] = [(s, v) for s, v in values if s < step]
                values.append((step, _float(cell)))
    return series


def _float(cell: str) -> float:
    try:
        return float(cell)
    except ValueError:
        return math.nan
