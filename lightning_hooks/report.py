"""Reading a run back from its TensorBoard event files: the per-layer table of the last epoch.

Tags follow ``<family>/<stat>/<layer>`` per layer, ``<family>/global/<stat>`` over all layers and
``<family>/alarms/<rule>`` for alarm counts (per epoch; the report sums them over the run, so an
alarm of an early epoch is not hidden by quiet later ones). A *run* is a directory holding event
files.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "COLUMNS",
    "FailRule",
    "LayerRow",
    "RunReport",
    "check",
    "find_runs",
    "format_table",
    "read_run",
]

COLUMNS: tuple[tuple[str, str], ...] = (
    ("dead_fraction", "dead_relu/dead_fraction"),
    ("grad_norm", "grad_flow/grad_norm"),
    ("update_ratio", "grad_flow/update_ratio"),
    ("grad_nonfinite", "grad_flow/grad_nonfinite"),
)
"""The table's columns: ``(name, family/stat)``; every other statistic is in the JSON only."""

_HEALTHY_UPDATE_RATIO = 1e-3  # the usual rule of thumb for ||dw|| / ||w|| per step


@dataclass
class LayerRow:
    """One layer's statistics at the last logged step (every ``family/stat`` found)."""

    layer: str
    values: dict[str, float] = field(default_factory=dict)

    def get(self, name: str) -> float:
        """A column by its short name (``grad_norm``) or full ``family/stat``; NaN if absent."""
        full = dict(COLUMNS).get(name, name)
        return self.values.get(full, math.nan)

    def severity(self) -> tuple[float, float, float, float]:
        """Sort key, worst first: non-finite gradients, no gradient at all, dead fraction, then
        the update ratio's distance from 1e-3 in decades."""
        norm = self.values.get("grad_flow/grad_norm", 1.0)
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
    """The last step of one run: its layers worst first, its global values, and its alarm
    counts per ``family/rule`` summed over the whole run."""

    run: str
    step: int
    layers: list[LayerRow]
    global_values: dict[str, float]
    alarms: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (NaN becomes ``None``)."""

        def clean(values: dict[str, float]) -> dict[str, float | None]:
            return {k: (None if math.isnan(v) else v) for k, v in values.items()}

        return {
            "run": self.run,
            "step": self.step,
            "alarms": clean(self.alarms),
            "global": clean(self.global_values),
            "layers": [{"layer": r.layer, **clean(r.values)} for r in self.layers],
        }


def find_runs(logdir: Path) -> list[Path]:
    """Every directory under ``logdir`` (itself included) that holds TensorBoard event files."""
    return sorted({p.parent for p in logdir.rglob("events.out.tfevents.*") if p.is_file()})


def read_run(run_dir: Path, logdir: Path) -> RunReport | None:
    """The report of the last logged step of one run, or ``None`` if it has no library tags."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    last: dict[str, tuple[int, float]] = {}
    totals: dict[str, float] = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        if events and tag.count("/") >= 2:
            last[tag] = (events[-1].step, events[-1].value)
            if tag.split("/")[1] == "alarms":  # counts per epoch: the run's total per rule
                totals[tag] = math.fsum(e.value for e in events)
    if not last:
        return None
    step = max(s for s, _ in last.values())
    return _build(str(run_dir.relative_to(logdir)) or ".", step, last, totals)


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
    alarms = ", ".join(f"{k}={_fmt(v)}" for k, v in report.alarms.items() if v) or "none"
    lines.append(f"alarms: {alarms}")
    return "\n".join(lines)


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "-"
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.3g}"


_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "==": operator.eq,
}
_RULE = re.compile(r"^\s*([A-Za-z0-9_./-]+)\s*(>=|<=|==|>|<)\s*([-+0-9.eE]+|inf|nan)\s*$")


@dataclass(frozen=True)
class FailRule:
    """``<metric><op><number>``, e.g. ``grad_nonfinite>0``, ``dead_fraction>=0.9``, ``alarms>0``.

    ``metric`` is a column (``dead_fraction``, ``grad_norm``, ``update_ratio``,
    ``grad_nonfinite``), any ``family/stat`` (``grad_flow/grad_abs_max``) checked on every layer,
    ``alarms`` (the sum of every alarm count) or one alarm ``family/alarms/rule``.

    Example:
        >>> FailRule.parse("dead_fraction>=0.9")
        FailRule(metric='dead_fraction', op='>=', threshold=0.9)
    """

    metric: str
    op: str
    threshold: float

    @classmethod
    def parse(cls, text: str) -> FailRule:
        """Parse ``text``; a ``ValueError`` names the expected form and what was received."""
        match = _RULE.match(text)
        if match is None:
            raise ValueError(
                f"--fail-on {text!r}: expected <metric><op><number> with op one of "
                f"{', '.join(_OPS)}, e.g. 'grad_nonfinite>0' or 'dead_fraction>=0.9'"
            )
        return cls(match[1], match[2], float(match[3]))

    def violations(self, report: RunReport) -> list[str]:
        """A line per layer (or alarm) of ``report`` that breaks the rule."""
        test = _OPS[self.op]
        name = f"{self.metric}{self.op}{self.threshold:g}"
        if self.metric == "alarms":
            total = sum(report.alarms.values())
            return (
                [f"{report.run}: alarms={total:g} ({name})"] if test(total, self.threshold) else []
            )
        if "/alarms/" in self.metric:
            family, _, rule = self.metric.partition("/alarms/")
            value = report.alarms.get(f"{family}/{rule}", math.nan)
            return [f"{report.run}: {self.metric}={value:g}"] if test(value, self.threshold) else []
        return [
            f"{report.run}: {row.layer} {self.metric}={row.get(self.metric):.4g} ({name})"
            for row in report.layers
            if test(row.get(self.metric), self.threshold)
        ]


def check(reports: Iterable[RunReport], rules: Sequence[FailRule]) -> list[str]:
    """Every violation of every rule in every report."""
    return [line for report in reports for rule in rules for line in rule.violations(report)]
