"""Reading a run back from its TensorBoard event files (or a ``CSVLogger``'s ``metrics.csv``): the
per-layer table of the last epoch.

Tags follow ``<family>/<stat>/<layer>`` per layer, ``<family>/global/<stat>`` over all layers and
``<family>/alarms/<rule>`` for alarm counts (per epoch; the report sums them over the run, so an
alarm of an early epoch is not hidden by quiet later ones). The values of one logging step have
``_step`` after the statistic (``<family>/<stat>_step/<layer>``): the report uses them for a run
whose last logging steps came after its last epoch end (still running, or killed). A *run* is a
directory holding event files, or a ``metrics.csv``.

The event files are read record by record with their checksums (TensorBoard's own reader stops
silently at a corrupt or truncated record): a file that cannot be read to its end raises
:class:`EventFileError`, naming the file and the byte offset.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from lightning_hooks.report_csv import METRICS_FILE, csv_series
from lightning_hooks.report_events import EventFileError, scalar_events
from lightning_hooks.report_model import ALARMS, COLUMNS, LAYER_METRICS, LayerRow, RunReport
from lightning_hooks.report_rules import FailRule, check

__all__ = [
    "ALARMS",
    "COLUMNS",
    "LAYER_METRICS",
    "EventFileError",
    "FailRule",
    "LayerRow",
    "RunReport",
    "attention_summary",
    "check",
    "find_runs",
    "format_table",
    "read_run",
    "scalar_events",
]


def find_runs(logdir: Path) -> list[Path]:
    """Every directory under ``logdir`` (itself included) that holds TensorBoard event files or
    a ``CSVLogger``'s ``metrics.csv``."""
    found = [*logdir.rglob("events.out.tfevents.*"), *logdir.rglob(METRICS_FILE)]
    return sorted({p.parent for p in found if p.is_file()})


def read_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of one run (its event files in name order, or else its ``CSVLogger``
    ``metrics.csv``) as ``[(step, value)]``.

    As TensorBoard does, a step lower than the tag's last one (a run resumed from a checkpoint)
    drops the tag's values from that step on.
    """
    if not any(run_dir.glob("events.out.tfevents.*")) and (run_dir / METRICS_FILE).is_file():
        return csv_series(run_dir / METRICS_FILE)
    series: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(run_dir.glob("events.out.tfevents.*")):
        for tag, step, value in scalar_events(path):
            values = series.setdefault(tag, [])
            if values and step < values[-1][0]:
                values[:] = [(s, v) for s, v in values if s < step]
            values.append((step, value))
    return series


def read_run(run_dir: Path, logdir: Path) -> RunReport | None:
    """The report of the last logged step of one run, or ``None`` if it has no library tags.

    The last epoch's aggregates; when the run logged steps after its last epoch end (a long
    epoch still running, or a run that died), the values of its last logging step
    (``<family>/<stat>_step/<layer>`` tags, reported under ``<family>/<stat>``) and the alarms
    counted at its logging steps since.

    Raises:
        EventFileError: one of the run's event files is corrupt or truncated.
    """
    epoch: dict[str, list[tuple[int, float]]] = {}
    steps: dict[str, list[tuple[int, float]]] = {}
    for tag, events in read_series(run_dir).items():
        if tag.endswith("/alarms/spike_score"):
            continue  # a rate (alarms per 1,000 steps), not a count to sum
        if tag.count("/") >= 2:
            name = _epoch_name(tag)
            if name is None:
                epoch[tag] = events
            else:
                steps[name] = events
    if not epoch and not steps:
        return None
    ended = max((events[-1][0] for events in epoch.values()), default=-1)
    source = epoch
    if max((events[-1][0] for events in steps.values()), default=-1) > ended:
        source = steps  # the values of its last logging step, after its last epoch end
    last = {tag: events[-1] for tag, events in source.items()}
    totals: dict[str, float] = {}
    for tag in last:
        if tag.split("/")[1] == "alarms":  # the run's total per rule
            counted = [v for _, v in epoch.get(tag, [])]
            if source is steps:
                counted += [v for s, v in steps[tag] if s > ended]
            totals[tag] = math.fsum(counted)
    step = max(s for s, _ in last.values())
    return _build(str(run_dir.relative_to(logdir)) or ".", step, last, totals)


_STEP_SUFFIX = re.compile(r"_step(_p\d+)?$")


def _epoch_name(tag: str) -> str | None:
    """The epoch tag of a logging step's tag (``grad_flow/grad_norm_step/x`` ->
    ``grad_flow/grad_norm/x``), ``None`` for an epoch tag."""
    parts = tag.split("/")
    at = 2 if parts[1] == "global" else 1
    plain = _STEP_SUFFIX.sub(r"\1", parts[at])
    if plain == parts[at]:
        return None
    parts[at] = plain
    return "/".join(parts)


def _build(
    run: str,
    step: int,
    last: dict[str, tuple[int, float]],
    totals: dict[str, float],
) -> RunReport:
    """``last``: each tag's last ``(step, value)``; ``totals``: each alarm tag's sum over the
    run (an alarm of an earlier epoch still counts)."""
    rows: dict[str, LayerRow] = {}
    global_values: dict[str, float] = {}
    alarms: dict[str, float] = {}
    for tag, (tag_step, value) in sorted(last.items()):
        family, stat, rest = tag.split("/", 2)
        if stat == "alarms":
            alarms[f"{family}/{rest}"] = totals[tag]
        elif tag_step != step:
            continue  # a layer not logged in the last epoch (max_layers_logged)
        elif stat == "global":
            global_values[f"{family}/{rest}"] = value
        else:
            rows.setdefault(rest, LayerRow(rest)).values[f"{family}/{stat}"] = value
    ordered = sorted(rows.values(), key=lambda r: (r.severity(), r.layer))
    return RunReport(run, step, ordered, global_values, alarms)


def format_table(report: RunReport, limit: int | None = None) -> str:
    """The report as a fixed-width text table, worst layer first."""
    present = [(n, full) for n, full in COLUMNS if any(full in r.values for r in report.layers)]
    header = ["layer", *(n for n, _ in present)]
    body = [
        [row.layer, *(_fmt(row.values.get(full, math.nan)) for _, full in present)]
        for row in report.layers[:limit]
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body, strict=True)]
    lines = [f"run {report.run}  (step {report.step}, {len(report.layers)} layers, worst first)"]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *body]
    ]
    if limit is not None and len(report.layers) > limit:
        lines.append(f"... {len(report.layers) - limit} more layers (--top to show more)")
    attention = attention_summary(report)
    if attention is not None:
        lines.append(attention)
    alarms = ", ".join(f"{k}={_fmt(v)}" for k, v in report.alarms.items() if v) or "none"
    lines.append(f"alarms: {alarms}")
    return "\n".join(lines)


_ATTENTION = (
    ("largest logit", "stability/attn_logit_max", max),
    ("lowest entropy", "stability/attn_entropy_min", min),
)


def attention_summary(report: RunReport) -> str | None:
    """The worst attention layer by its largest logit and by its lowest head entropy, as one
    line (``None`` when the run logged no attention statistic).

    Example:
        >>> rows = [LayerRow("h.0", {"stability/attn_logit_max": 9.0,
        ...                          "stability/attn_entropy_min": 0.5}),
        ...         LayerRow("h.1", {"stability/attn_logit_max": 3.0,
        ...                          "stability/attn_entropy_min": 0.25})]
        >>> attention_summary(RunReport("run", 7, rows, {}, {}))
        'attention: largest logit 9 at h.0; lowest entropy 0.25 at h.1'
    """
    parts = []
    for label, full, pick in _ATTENTION:
        rows = [r for r in report.layers if not math.isnan(r.values.get(full, math.nan))]
        if rows:
            worst = pick(rows, key=lambda r: r.values[full])
            parts.append(f"{label} {_fmt(worst.values[full])} at {worst.layer}")
    return f"attention: {'; '.join(parts)}" if parts else None


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "-"
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.3g}"
