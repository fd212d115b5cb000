"""Reading a run back, as ``lightning-hooks report`` prints it.

A run is TensorBoard event files, or a ``CSVLogger``'s ``metrics.csv``; what is read back is the
per-layer table of its last epoch, its warnings and its notices. Event files are read with their
checksums; no torch or Lightning is imported.
"""

from __future__ import annotations

import csv
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_hooks.tags import (
    ALARMS,
    DEAD_RELU,
    GLOBAL,
    GRAD_FLOW,
    LIBRARY_FAMILIES,
    NOTICE_COUNTS,
    NOTICES,
    NOTICES_0_2_0,
    SPIKE_SCORE,
    STABILITY,
    epoch_tag,
    layer_metric,
    notice_tag,
)

if TYPE_CHECKING:
    from tensorboard.compat.proto.summary_pb2 import Summary

__all__ = [
    "COLUMNS",
    "METRICS_FILE",
    "EventFileError",
    "LayerRow",
    "RunReport",
    "find_runs",
    "format_table",
    "read_run",
]

COLUMNS: tuple[tuple[str, str], ...] = (
    ("dead_fraction", layer_metric(DEAD_RELU, "dead_fraction")),
    ("grad_norm", layer_metric(GRAD_FLOW, "grad_norm")),
    ("update_ratio", layer_metric(GRAD_FLOW, "update_ratio")),
    ("grad_nonfinite", layer_metric(GRAD_FLOW, "grad_nonfinite")),
)
"""The table's columns: ``(name, family/stat)``; every other statistic is in the JSON only."""

_GRAD_NORM = layer_metric(GRAD_FLOW, "grad_norm")

_HEALTHY_UPDATE_RATIO = 1e-3  # the usual rule of thumb for ||dw|| / ||w|| per step


@dataclass
class LayerRow:
    """One layer's statistics at the last logged step (every ``family/stat`` found)."""

    layer: str
    values: dict[str, float] = field(default_factory=dict)

    def get(self, name: str) -> float:
        """Return a column's value by its short name (``grad_norm``) or full ``family/stat``.

        Args:
            name: a column's short name (:data:`COLUMNS`) or a full ``family/stat``.

        Returns:
            The layer's value, NaN if absent.
        """
        return self.values.get(dict(COLUMNS).get(name, name), math.nan)

    @property
    def no_gradient(self) -> bool:
        """Whether the layer got no gradient.

        Its gradient-flow row was logged (its weight norm, its update ratio of 0) without a
        gradient norm, or with one of exactly 0. Its update ratio is then no measurement of a
        step size: no step was taken.

        Example:
            >>> LayerRow("aux_head", {"grad_flow/update_ratio": 0.0}).no_gradient
            True
            >>> LayerRow("net.0", {"grad_flow/grad_norm": 0.2}).no_gradient
            False
        """
        flows = any(full.startswith(f"{GRAD_FLOW}/") for full in self.values)
        norm = self.values.get(_GRAD_NORM, math.nan)
        return flows and (norm == 0 or math.isnan(norm)) and not self.get("grad_nonfinite") > 0

    def severity(self) -> tuple[float, float, float, float]:
        """Return the layer's sort key, worst first.

        Returns:
            Its keys in turn: non-finite gradients, no gradient at all, dead fraction, then the
            update ratio's distance from 1e-3 in decades (each negated: the worst sorts first).
        """
        norm = self.values.get(_GRAD_NORM, 1.0)
        broken = self.get("grad_nonfinite") > 0 or not math.isfinite(norm)
        dead = self.get("dead_fraction")
        ratio = self.get("update_ratio")
        off = abs(math.log10(ratio / _HEALTHY_UPDATE_RATIO)) if ratio > 0 else math.inf
        return (
            -float(broken),
            -float(norm == 0),
            -(dead if not math.isnan(dead) else 0.0),
            -(off if not math.isnan(ratio) else 0.0),
        )


@dataclass
class RunReport:
    """The last step of one run that logged layers.

    It holds the step's layers worst first, its global values, the run's warnings and notices per
    tag summed over the whole run, and the warnings logged after that step, when an alarm ended
    the run there (``on_alarm="raise"``).
    """

    run: str
    step: int
    layers: list[LayerRow]
    global_values: dict[str, float]
    warnings: dict[str, float]
    """Per ``<family>/alarms/<rule>``: how often the rule warned (or stopped, raised, skipped)."""
    notices: dict[str, float]
    """Per ``<family>/notices/<name>``: how often it was only noticed (:data:`NOTICES`)."""
    ended_by: dict[str, float] = field(default_factory=dict)
    """The warnings logged at :attr:`ended_at`, after :attr:`step`: the alarm that ended the
    run, its last record."""
    ended_at: int | None = None
    """The step of :attr:`ended_by` (``None``: no alarm ended the run after its last layers)."""

    def to_json(self) -> dict[str, Any]:
        """Return the report as a JSON-ready dict (NaN becomes ``None``).

        Returns:
            The run, step, warnings, notices, how the run ended (``None``: no alarm ended it),
            global values and layers, worst first (a layer that got no gradient marked so).
        """

        def clean(values: dict[str, float]) -> dict[str, float | None]:
            return {k: (None if math.isnan(v) else v) for k, v in values.items()}

        return {
            "run": self.run,
            "step": self.step,
            "warnings": clean(self.warnings),
            "notices": clean(self.notices),
            "ended": None
            if self.ended_at is None
            else {"step": self.ended_at, "by": clean(self.ended_by)},
            "global": clean(self.global_values),
            "layers": [
                {
                    "layer": r.layer,
                    **clean(r.values),
                    **({"no_gradient": True} if r.no_gradient else {}),
                }
                for r in self.layers
            ],
        }


METRICS_FILE = "metrics.csv"
"""The file a ``CSVLogger`` writes its scalars to, in its ``log_dir``."""


def _csv_series(path: Path) -> dict[str, list[tuple[int, float]]]:
    r"""Read every scalar column of a ``metrics.csv`` as ``[(step, value)]`` per tag, in order.

    A step lower than the tag's last one (a resumed run) drops its values from that step on.

    Args:
        path: the ``metrics.csv`` file.

    Returns:
        Each tag's series; an empty cell is no value, and one that is no number is NaN.

    Raises:
        EventFileError: a row is cut off: it has fewer cells than the header, or no step.

    Example:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "metrics.csv"
        >>> _ = path.write_text("a/b/c,step\n1.5,0\n,1\n2.5,2\n")
        >>> _csv_series(path)
        {'a/b/c': [(0, 1.5), (2, 2.5)]}
    """
    series: dict[str, list[tuple[int, float]]] = {}
    with path.open(newline="", encoding="utf-8") as file:
        for line, row in enumerate(csv.DictReader(file), start=2):
            if None in row.values() or not row.get("step"):
                # fewer cells than the header: a row cut off (a run killed while it wrote)
                raise EventFileError(f"{path}: row {line} is cut off (it has no step)")
            step = int(float(row["step"]))
            for tag, cell in row.items():
                if tag != "step" and cell:
                    _append(series, tag, step, _float(cell))
    return series


def _append(series: dict[str, list[tuple[int, float]]], tag: str, step: int, value: float) -> None:
    """Add ``(step, value)`` to ``tag``'s series, as :func:`_csv_series` says.

    A step lower than the series' last drops its values from that step on.
    """
    values = series.setdefault(tag, [])
    if values and step < values[-1][0]:
        values[:] = [(s, v) for s, v in values if s < step]
    values.append((step, value))


def _float(cell: str) -> float:
    """Return a cell's number, NaN for one that is no number."""
    try:
        return float(cell)
    except ValueError:
        return math.nan


class EventFileError(ValueError):
    """An event file that cannot be read to its end: a corrupt or a truncated record."""


def _scalar_events(path: Path) -> Iterator[tuple[str, int, float]]:
    """Yield ``(tag, step, value)`` of every scalar in one event file, in file order.

    Every record's length checksum is checked, and the payload checksum of those with a scalar.

    Args:
        path: the event file.

    Yields:
        Each scalar's tag, step and value.

    Raises:
        EventFileError: a record is corrupt (bad checksum or undecodable) or truncated.
    """
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto.event_pb2 import Event

    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        payload, payload_crc, end = _record(data, offset, path)
        try:
            event = Event.FromString(payload)
        except DecodeError as error:
            raise EventFileError(f"{path}: corrupt record at byte {offset} ({error})") from None
        scalars = []
        for v in event.summary.value:
            x = _scalar(v)
            if x is not None:
                scalars.append((v.tag, x))
        if scalars and _masked_crc32c(payload) != payload_crc:
            raise EventFileError(f"{path}: corrupt record at byte {offset} (checksum mismatch)")
        for tag, value in scalars:
            yield tag, event.step, value
        offset = end


def _record(data: bytes, offset: int, path: Path) -> tuple[bytes, int, int]:
    """Read the TFRecord at ``offset``, its length's checksum checked.

    Args:
        data: the whole event file.
        offset: where the record begins.
        path: the file, named in an error.

    Returns:
        ``(payload, payload checksum, offset of the next record)``.

    Raises:
        EventFileError: the header's checksum does not match, or the file ends inside the record.
    """
    size = len(data)
    if offset + 12 > size:
        raise EventFileError(
            f"{path}: truncated: the file ends inside the record header at byte {offset} "
            f"({size} bytes; a run still being written, or a file cut short)"
        )
    length, length_crc = struct.unpack_from("<QI", data, offset)
    if _masked_crc32c(data[offset : offset + 8]) != length_crc:
        raise EventFileError(f"{path}: corrupt record header at byte {offset} (checksum mismatch)")
    start = offset + 12
    end = offset + 12 + length
    if end + 4 > size:
        raise EventFileError(
            f"{path}: truncated: the record at byte {offset} needs {length + 16} bytes, the file "
            f"ends after {size - offset} (a run still being written, or a file cut short)"
        )
    (payload_crc,) = struct.unpack_from("<I", data, end)
    return data[start:end], payload_crc, end + 4


def _masked_crc32c(data: bytes) -> int:
    """Return TFRecord's masked CRC-32C of ``data``, as TensorBoard computes it."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    return int(masked_crc32c(data))


def _scalar(value: Summary.Value) -> float | None:
    """Return a summary value's scalar: a ``simple_value`` or a scalar-plugin tensor.

    Returns:
        The scalar, else ``None``.
    """
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars":
        from tensorboard.util.tensor_util import make_ndarray

        return float(make_ndarray(value.tensor).item())
    return None


def find_runs(logdir: Path) -> list[Path]:
    """Find every folder under ``logdir`` (itself included) with event files or a ``metrics.csv``.

    Symbolic links to folders are followed, each real folder once.

    Args:
        logdir: the folder searched.

    Returns:
        The run folders, sorted.
    """
    found = set()
    seen = set()
    for folder, dirs, files in os.walk(logdir, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:  # a link back up the tree, or a second link to one folder
            dirs.clear()
            continue
        seen.add(real)
        if METRICS_FILE in files or any(f.startswith("events.out.tfevents.") for f in files):
            found.add(Path(folder))
    return sorted(found)


def _read_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Read every scalar tag of one run as ``[(step, value)]``.

    A run is its event files in name order, or else its ``metrics.csv``; a resumed run's values
    are kept as :func:`_csv_series` keeps them. An event file whose first step is not past the
    steps logged before it is a resumed run's: every tag's values from that step on are dropped.
    """
    paths = sorted(run_dir.glob("events.out.tfevents.*"))
    if not paths and (run_dir / METRICS_FILE).is_file():
        return _csv_series(run_dir / METRICS_FILE)
    series: dict[str, list[tuple[int, float]]] = {}
    last = -1
    for path in paths:
        first = True
        for tag, step, value in _scalar_events(path):
            if first and step <= last:
                # A run resumed from an earlier checkpoint into the same folder: what the files
                # before logged from this step on, under every tag, belongs to the branch it left.
                for values in series.values():
                    values[:] = [(s, v) for s, v in values if s < step]
            first = False
            _append(series, tag, step, value)
            last = max(last, step)
    return series


_Series = dict[str, list[tuple[int, float]]]
"""Each tag's ``[(step, value)]``, in the order logged."""


def read_run(run_dir: Path, logdir: Path) -> RunReport | None:
    """Read the report of the last step of one run that logged layers.

    The report holds the last epoch's values (or a later logging step's), warnings and notices
    summed over the run, and the warnings an alarm that ended the run logged after that step.

    Args:
        run_dir: the run's folder (see :func:`find_runs`).
        logdir: the folder searched, which the run's name is relative to.

    Returns:
        The report, or ``None`` if the run has no library tags.

    Raises:
        EventFileError: one of the run's event files is corrupt or truncated.
    """
    epoch: _Series = {}
    steps: _Series = {}
    for tag, events in _read_series(run_dir).items():
        # spike_score: a rate, not a count to sum
        if tag.count("/") >= 2 and tag != SPIKE_SCORE:
            name = epoch_tag(tag)
            (epoch if name is None else steps)[name or tag] = events
    if not epoch and not steps:
        return None
    if not any(_kind(tag) == NOTICE_COUNTS for tag in [*epoch, *steps]):
        epoch = _notices_0_2_0(epoch)
        steps = _notices_0_2_0(steps)
    # the step is the last that logged layers: an alarm's counts may come after it
    layered = max(_last_step(epoch, counts=False), _last_step(steps, counts=False))
    late = _last_step(steps, counts=False) > _last_step(epoch, counts=False)
    source = steps if late else epoch
    last = {tag: events[-1] for tag, events in source.items() if _kind(tag) is None}
    if late:
        _carry_epoch_only_statistics(last, epoch, steps, layered)
    ended = _last_step(epoch, counts=True)
    totals = {
        tag: math.fsum(
            [v for _, v in epoch.get(tag, [])] + [v for s, v in steps.get(tag, []) if s > ended]
        )
        for tag in {*epoch, *steps}
        if _kind(tag) is not None
    }
    step = layered if layered >= 0 else max(_last_step(epoch, True), _last_step(steps, True))
    report = _build(_run_name(run_dir, logdir), step, last, totals)
    _ending(report, steps)
    return report


def _carry_epoch_only_statistics(
    last: dict[str, tuple[int, float]], epoch: _Series, steps: _Series, step: int
) -> None:
    """Add to ``last`` the last epoch's values of the statistics no logging step logs.

    A run reported at a logging step after its last epoch end has no value there of a statistic
    logged at epoch ends only (``dead_relu/dead_fraction``): its last epoch's values stand for it,
    at ``step``, so that a rule on it still checks the run.
    """
    logged_at_steps = {_statistic(tag) for tag in steps}
    epoch_end = _last_step(epoch, counts=False)
    for tag, events in epoch.items():
        at, value = events[-1]
        if _kind(tag) is None and at == epoch_end and _statistic(tag) not in logged_at_steps:
            last[tag] = (step, value)


def _statistic(tag: str) -> str:
    """Return a layer tag's ``family/stat``."""
    family, stat, _ = tag.split("/", 2)
    return f"{family}/{stat}"


def _kind(tag: str) -> str | None:
    """Return ``alarms`` for a warnings' count tag, ``notices`` for a notices', else ``None``."""
    stat = tag.split("/")[1]
    return stat if stat in (ALARMS, NOTICE_COUNTS) else None


def _last_step(series: _Series, counts: bool) -> int:
    """Return the last step logged by the count tags (``counts``) or by the others; -1 if none."""
    return max(
        (events[-1][0] for tag, events in series.items() if (_kind(tag) is not None) == counts),
        default=-1,
    )


def _notices_0_2_0(series: _Series) -> _Series:
    """Read a run written by 0.2.0 (no notices) with today's notices.

    Its counts of the rules it only logged or counted under its default ``on_alarm``
    (:data:`NOTICES_0_2_0`) are read as the notices they are today.
    """
    return {_tag_0_2_0(tag): events for tag, events in series.items()}


def _tag_0_2_0(tag: str) -> str:
    """Return the tag today of a 0.2.0 run's ``tag``: a notice's, for a rule it only logged."""
    family, stat, rule = tag.split("/", 2)
    if family == GRAD_FLOW and stat == ALARMS and rule in NOTICES_0_2_0:
        return notice_tag(NOTICES_0_2_0[rule])
    return tag


def _ending(report: RunReport, steps: _Series) -> None:
    """Set ``report``'s :attr:`~RunReport.ended_by` and :attr:`~RunReport.ended_at`.

    They are the warnings logged at a logging step after its last layers: the record an alarm
    writes before it raises.
    """
    after = {
        tag: (s, v)
        for tag, events in steps.items()
        if _kind(tag) == ALARMS
        for s, v in events[-1:]
        if s > report.step and v > 0
    }
    if after:
        at = max(s for s, _ in after.values())
        report.ended_at = at
        report.ended_by = {tag: v for tag, (s, v) in sorted(after.items()) if s == at}


def _run_name(run_dir: Path, logdir: Path) -> str:
    """Return the run's folder under ``logdir``; ``logdir`` itself by its own name (not ``.``)."""
    relative = str(run_dir.relative_to(logdir))
    return relative if relative != "." else run_dir.resolve().name


def _build(
    run: str, step: int, last: dict[str, tuple[int, float]], totals: dict[str, float]
) -> RunReport:
    """Build the report of ``step`` from the run's last values and its totals.

    Args:
        run: the run's name.
        step: the last step that logged layers; a layer not logged at it is left out.
        last: each layer's or global tag's last ``(step, value)``.
        totals: each count tag's run total.
    """
    rows: dict[str, LayerRow] = {}
    global_values: dict[str, float] = {}
    for tag, (tag_step, value) in sorted(last.items()):
        family, stat, rest = tag.split("/", 2)
        if tag_step != step:
            continue  # a layer not logged in the last epoch (max_layers_logged)
        if stat == GLOBAL:
            global_values[layer_metric(family, rest)] = value
        else:
            rows.setdefault(rest, LayerRow(rest)).values[layer_metric(family, stat)] = value
    ordered = sorted(rows.values(), key=lambda r: (r.severity(), r.layer))
    # keyed by its tag: the name --fail-on takes
    warnings = {tag: n for tag, n in sorted(totals.items()) if _kind(tag) == ALARMS}
    notices = {tag: n for tag, n in sorted(totals.items()) if _kind(tag) == NOTICE_COUNTS}
    return RunReport(run, step, ordered, global_values, warnings, notices)


def format_table(report: RunReport, limit: int | None = None) -> str:
    """Format the report as a fixed-width text table, worst layer first.

    The columns are the library's that the run logged, then one per statistic of the user's own
    (``family/stat``). Lines for the attention layers, the alarm that ended the run, the warnings
    and the notices follow.

    Args:
        report: the run's report.
        limit: how many layers to show (``None``: all).

    Returns:
        The table, one line per layer.
    """
    present = [(n, full) for n, full in COLUMNS if any(full in r.values for r in report.layers)]
    custom = {
        full
        for row in report.layers
        for full in row.values
        if full.split("/")[0] not in LIBRARY_FAMILIES
    }
    present += [(full, full) for full in sorted(custom)]
    header = ["layer", *(n for n, _ in present)]
    body = [[_layer_cell(row), *_cells(row, present)] for row in report.layers[:limit]]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body, strict=True)]
    lines = [f"run {report.run}  (step {report.step}, {len(report.layers)} layers, worst first)"]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *body]
    ]
    if limit is not None and len(report.layers) > limit:
        lines.append(f"... {len(report.layers) - limit} more layers (--top to show more)")
    attention = _attention_summary(report)
    if attention is not None:
        lines.append(attention)
    if report.ended_at is not None:
        by = ", ".join(f"{k}={_fmt(v)}" for k, v in report.ended_by.items())
        lines.append(f"ended: at step {report.ended_at}, after the layers above, by {by}")
    warnings = ", ".join(f"{k}={_fmt(v)}" for k, v in report.warnings.items() if v) or "none"
    lines.append(f"warnings: {warnings}")
    notices = ", ".join(f"{_notice_name(k)}={_fmt(v)}" for k, v in report.notices.items() if v)
    lines.append(f"notices: {notices or 'none'}")
    return "\n".join(lines)


_NO_GRADIENT = "(no gradient)"
"""The mark of a layer that got no gradient (:attr:`LayerRow.no_gradient`), after its name."""


def _layer_cell(row: LayerRow) -> str:
    """Return the layer's name, marked when it got no gradient."""
    return f"{row.layer} {_NO_GRADIENT}" if row.no_gradient else row.layer


def _cells(row: LayerRow, present: list[tuple[str, str]]) -> list[str]:
    """Return the row's cells of the ``present`` columns.

    A layer that got no gradient shows no update ratio (``-``): a ratio of 0 there measures no
    step.
    """
    return [
        "-" if name == "update_ratio" and row.no_gradient else _fmt(row.values.get(full, math.nan))
        for name, full in present
    ]


def _notice_name(tag: str) -> str:
    """Return a notice's name in the report: its column (:data:`NOTICES`), else its tag."""
    family, _, name = tag.split("/", 2)
    notice = NOTICES.get(name)
    return notice.column if family == GRAD_FLOW and notice is not None else tag


_ATTENTION = (
    ("largest logit", layer_metric(STABILITY, "attn_logit_max"), max),
    ("lowest entropy", layer_metric(STABILITY, "attn_entropy_min"), min),
)


def _attention_summary(report: RunReport) -> str | None:
    """Return the worst attention layer by its largest logit and by its lowest head entropy.

    It is one line, ``None`` when the run logged no attention statistic.
    """
    parts = []
    for label, full, pick in _ATTENTION:
        rows = [r for r in report.layers if not math.isnan(r.values.get(full, math.nan))]
        if rows:
            worst = pick(rows, key=lambda r: r.values[full])
            parts.append(f"{label} {_fmt(worst.values[full])} at {worst.layer}")
    return f"attention: {'; '.join(parts)}" if parts else None


def _fmt(value: float) -> str:
    """Format a value for the table: ``-`` for NaN, a whole number as such, else 3 digits."""
    if math.isnan(value):
        return "-"
    if abs(value) < 1e6 and value == int(value):
        return str(int(value))
    return f"{value:.3g}"
