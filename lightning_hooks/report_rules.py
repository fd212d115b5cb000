"""``lightning-hooks report --fail-on``: the rules, checked against every run; a rule that names
an unknown metric, or one a run never logged, is an error (a typo in a CI gate fails)."""

from __future__ import annotations

import difflib
import math
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from lightning_hooks.report_model import ALARMS, COLUMNS, LAYER_METRICS, RunReport

__all__ = ["FailRule", "check", "known_metrics"]

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

    def problems(self, reports: Sequence[RunReport]) -> list[str]:
        """Why the rule cannot be checked: an unknown metric (the message lists the known ones),
        or a run that never logged what it asks for. Empty when every run has it."""
        logged = [_logged(report, self.metric) for report in reports]
        if not any(logged) and self.metric not in known_metrics():
            return [_unknown(self.metric, reports)]
        return [
            f"{report.run}: logged no {_describe(self.metric)} (rule {self.text!r})"
            for report, found in zip(reports, logged, strict=True)
            if not found
        ]

    @property
    def text(self) -> str:
        """The rule as written, normalised: ``dead_fraction>=0.9``."""
        return f"{self.metric}{self.op}{self.threshold:g}"

    def violations(self, report: RunReport) -> list[str]:
        """A line per layer (or alarm) of ``report`` that breaks the rule."""
        test = _OPS[self.op]
        name = self.text
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


def known_metrics() -> list[str]:
    """Every metric a ``--fail-on`` rule may name that the library logs, in the order listed to
    a user who misspelt one: the columns, ``alarms``, each ``family/stat``, each alarm rule."""
    return [
        *(name for name, _ in COLUMNS),
        "alarms",
        *(f"{family}/{stat}" for family, stats in LAYER_METRICS.items() for stat in stats),
        *(f"{family}/alarms/{rule}" for family, rules in ALARMS.items() for rule in rules),
    ]


def _logged(report: RunReport, metric: str) -> bool:
    if metric == "alarms":
        return bool(report.alarms)
    if "/alarms/" in metric:
        family, _, rule = metric.partition("/alarms/")
        return f"{family}/{rule}" in report.alarms
    full = dict(COLUMNS).get(metric, metric)
    return any(full in row.values for row in report.layers)


_CALLBACK = {
    "grad_flow": "GradFlowCallback",
    "activations": "ActivationStatsCallback",
    "dead_relu": "DeadReLUCallback",
    "saturation": "SaturationCallback",
    "layer_time": "LayerTimeCallback",
    "feature_map": "FeatureMapCallback",
    "stability": "GradFlowCallback",
}


def _describe(metric: str) -> str:
    """What a run that lacks ``metric`` lacks, and which callback would log it."""
    if metric == "alarms":
        return "alarm counts <family>/alarms/<rule> (GradFlowCallback(alarms=False)?)"
    full = dict(COLUMNS).get(metric, metric)
    callback = _CALLBACK.get(full.split("/")[0])
    return f"{full} (is {callback} in the Trainer?)" if callback else full


def _unknown(metric: str, reports: Sequence[RunReport]) -> str:
    """An unknown metric's message: the closest names, then every known one."""
    known = known_metrics()
    seen = {f for r in reports for row in r.layers for f in row.values if f not in known}
    names = [*known, *sorted(seen)]
    close = difflib.get_close_matches(metric, names, n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    return f"--fail-on: unknown metric {metric!r}{hint}; known: {', '.join(names)}"


def check(reports: Iterable[RunReport], rules: Sequence[FailRule]) -> list[str]:
    """Every violation of every rule in every report."""
    return [line for report in reports for rule in rules for line in rule.violations(report)]
