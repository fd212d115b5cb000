"""The ``lightning-hooks`` command, which reads runs back and checks them as a CI gate.

``lightning-hooks report LOGDIR`` reads the runs back (:mod:`lightning_hooks.report`) and checks
its ``--fail-on`` rules against every run.

Exit codes: 0 all good, 1 a ``--fail-on`` rule was broken, 2 a usage error, including a rule
that cannot be checked, a corrupt event file or no events (a typo in a CI gate never passes).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import operator
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from lightning_hooks.report import (
    COLUMNS,
    EventFileError,
    RunReport,
    find_runs,
    format_table,
    read_run,
)
from lightning_hooks.switch import SHORT_NAMES
from lightning_hooks.tags import GRAD_FLOW, NOTICES, Notice, alarm_tag, layer_metric, notice_tag

__all__ = ["LAYER_METRICS", "RULES", "FailRule", "check", "known_metrics", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

LAYER_METRICS: dict[str, tuple[str, ...]] = {
    "grad_flow": (
        *("grad_norm", "grad_norm_max", "grad_abs_mean", "grad_abs_max", "grad_nonfinite"),
        *("weight_norm", "update_ratio", "update_ratio_max"),
        *("output_grad_norm", "output_grad_norm_max"),
    ),
    "activations": (
        *("mean", "std", "min", "max", "abs_mean", "zero_fraction", "nonfinite"),
        *("kurtosis", "outlier_ratio"),
    ),
    "dead_relu": ("dead_fraction", "dead_count", "zero_fraction"),
    "saturation": ("saturated_fraction", "always_saturated_fraction"),
    "layer_time": ("forward_ms", "share"),
    "feature_map": ("abs_mean",),
    "stability": ("attn_logit_max", "attn_entropy_min", "logit_logz", "logit_logz_max"),
}
"""Every per-layer ``family/stat`` the library's callbacks log (a test holds it to a real fit)."""

RULES: dict[str, tuple[str, ...]] = {
    "grad_flow": (
        *("spike", "explosion", "absolute", "vanishing", "nonfinite", "amp_overflow"),
        "no_gradient",
        *("loss_spike", "diverging", "setback", "stall", "attention"),
    ),
}
"""Every alarm rule the library counts (``lightning_hooks.core.ALARM_RULES``, which the CLI
cannot import without torch: a test holds the two equal). A rule that acts is counted under
``family/alarms/rule``; one that is only logged, under ``family/notices/rule``."""

_OLD_NAMES = {"alarms": "warnings"}
"""Metrics renamed since 0.2.0, by their old name: ``alarms`` summed the notices too."""

_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "==": operator.eq,
}
_RULE = re.compile(r"^\s*([A-Za-z0-9_./-]+)\s*(>=|<=|==|>|<)\s*([-+]?[0-9.eE+-]+|[-+]?inf)\s*$")


@dataclass(frozen=True)
class FailRule:
    """A ``--fail-on`` rule: ``<metric><op><number>``.

    For example ``grad_nonfinite>0``, ``dead_fraction>=0.9`` or ``warnings>0``.

    ``metric`` is a column (``dead_fraction``, ``grad_norm``, ``update_ratio``,
    ``grad_nonfinite``), any ``family/stat`` (``grad_flow/grad_abs_max``) checked on every layer,
    ``warnings`` (the sum of every alarm that warned, ``family/alarms/rule``), one alarm
    ``family/alarms/rule``, ``notices`` (the sum of the notices a rule may name), or one notice
    by its tag ``family/notices/name`` or its column (``setbacks``) where its ``gate`` allows.

    Attributes:
        metric: what the rule checks: a column, a ``family/stat``, or a count (a notice named by
            its column stands for its tag).
        op: the comparison, one of ``>=``, ``<=``, ``==``, ``>`` and ``<``.
        threshold: the number the metric is compared with.

    Example:
        >>> FailRule.parse("dead_fraction>=0.9")
        FailRule(metric='dead_fraction', op='>=', threshold=0.9)
    """

    metric: str
    op: str
    threshold: float

    @classmethod
    def parse(cls, text: str) -> FailRule:
        """Parse a rule as the user wrote it.

        Args:
            text: the rule, ``<metric><op><number>`` (spaces around the parts allowed).

        Returns:
            The rule; a notice named by its column stands for its tag.

        Raises:
            ValueError: ``text`` is not of that form; the message names the expected form and
                what was received.
        """
        match = _RULE.match(text)
        expected = (
            f"--fail-on {text!r}: expected <metric><op><number> with op one of "
            f"{', '.join(_OPS)}, e.g. 'grad_nonfinite>0' or 'dead_fraction>=0.9'"
        )
        if match is None:
            raise ValueError(expected)
        try:
            threshold = float(match[3])
        except ValueError:
            raise ValueError(f"{expected}; {match[3]!r} is not a number") from None
        return cls(_NOTICE_COLUMNS.get(match[1], match[1]), match[2], threshold)

    def problems(self, reports: Sequence[RunReport]) -> list[str]:
        """Return why the rule cannot be checked.

        The reasons are a notice no gate may name, an unknown metric (the message lists the
        known ones), or no run logged what it asks for.

        Args:
            reports: every run read.

        Returns:
            One message per reason; empty when a run has the metric.
        """
        notice = _notice(self.metric)
        if notice is not None and not notice.gate:
            return [
                f"--fail-on {self.text!r}: {notice.column} ({notice.tag}) is a notice no gate "
                f"may name: {notice.about}"
            ]
        if any(_logged(report, self.metric) for report in reports):
            return []
        if self.metric not in known_metrics():
            return [_unknown(self.metric, reports)]
        return [f"no run logged {_describe(self.metric, reports)} (rule {self.text!r})"]

    def renamed(self) -> str | None:
        """Return a note when the rule names a metric by its 0.2.0 name; else ``None``."""
        new = _OLD_NAMES.get(self.metric)
        if new is None:
            return None
        return (
            f"--fail-on {self.text!r}: {self.metric!r} is now {new!r}: it counts the alarms that "
            f"warned, not the notices (write '{new}{self.op}{self.threshold:g}')"
        )

    def unchecked(self, reports: Sequence[RunReport]) -> list[str]:
        """Return the runs the rule is not checked on: they never logged what it asks for.

        Such is a folder of runs where only some had the callback that logs it.

        Args:
            reports: every run read.

        Returns:
            One line per run not checked, naming what it did not log.
        """
        return [
            f"{report.run}: logged no {_describe(self.metric, [report])}, not checked "
            f"(rule {self.text!r})"
            for report in reports
            if not _logged(report, self.metric)
        ]

    @property
    def text(self) -> str:
        """The rule as written, normalised: ``dead_fraction>=0.9``."""
        return f"{self.metric}{self.op}{self.threshold:g}"

    def violations(self, report: RunReport) -> list[str]:
        """Return a line per layer (or alarm) of ``report`` that breaks the rule.

        A count (``warnings``, an alarm, ``notices``, a notice) is summed and checked once.

        Args:
            report: one run's report.

        Returns:
            One line per violation, each naming the run, the layer or count, its value and the
            rule; empty when the run passes.
        """
        test = _OPS[self.op]
        name = self.text
        counts = _counts(report, self.metric)
        if counts is not None:
            total = math.fsum(counts.values())
            return (
                [f"{report.run}: {self.metric}={total:g} ({name})"]
                if test(total, self.threshold)
                else []
            )
        return [
            f"{report.run}: {row.layer} {self.metric}={row.get(self.metric):.4g} ({name})"
            for row in report.layers
            if test(row.get(self.metric), self.threshold)
        ]


_NOTICE_COLUMNS = {notice.column: notice.tag for notice in NOTICES.values()}
"""A notice's column, in a ``--fail-on`` rule, stands for its tag."""


def _notice(metric: str) -> Notice | None:
    """Return the notice of :data:`NOTICES` that ``metric`` (its tag) names, if any."""
    family, _, name = metric.partition("/notices/")
    notice = NOTICES.get(name)
    return notice if family == GRAD_FLOW and notice is not None else None


def known_metrics() -> list[str]:
    """Return every metric a ``--fail-on`` rule may name.

    Returns:
        The columns, ``warnings``, ``notices``, each ``family/stat``, each alarm rule's warnings
        and notices, each notice's column (the order a user who misspelt one reads them in).
    """
    never = {notice.name for notice in NOTICES.values() if not notice.acts}
    closed = {notice.name for notice in NOTICES.values() if not notice.gate}
    return [
        *(name for name, _ in COLUMNS),
        "warnings",
        "notices",
        *(layer_metric(family, stat) for family, stats in LAYER_METRICS.items() for stat in stats),
        *(alarm_tag(rule, f) for f, rules in RULES.items() for rule in rules if rule not in never),
        *(
            notice_tag(rule, f)
            for f, rules in RULES.items()
            for rule in rules
            if rule not in closed
        ),
        *(notice.column for notice in NOTICES.values() if notice.gate),
    ]


def _counts(report: RunReport, metric: str) -> dict[str, float] | None:
    """Return the counts ``metric`` sums in ``report``.

    They are all its warnings, the notices a gate may name, or one count by its tag (empty when
    not logged); ``None`` for a per-layer metric.
    """
    if metric == "warnings":
        return report.warnings
    if metric == "notices":
        return {tag: n for tag, n in report.notices.items() if _gated(tag)}
    if "/alarms/" in metric:
        return {metric: report.warnings[metric]} if metric in report.warnings else {}
    if "/notices/" in metric:
        return {metric: report.notices[metric]} if metric in report.notices else {}
    return None


def _gated(tag: str) -> bool:
    """Return whether a gate counts the notice ``tag`` in ``notices``."""
    notice = _notice(tag)
    return notice is None or notice.gate


def _logged(report: RunReport, metric: str) -> bool:
    """Return whether ``report`` holds ``metric`` (on any layer).

    A run that counted any alarm or notice holds ``warnings`` and ``notices``, zero included.
    """
    if metric in ("warnings", "notices"):
        return bool(report.warnings or report.notices)
    counts = _counts(report, metric)
    if counts is not None:
        return bool(counts)
    full = dict(COLUMNS).get(metric, metric)
    return any(full in row.values for row in report.layers)


_CALLBACK = {
    **SHORT_NAMES,
    "activations": "ActivationStatsCallback",
    "stability": "GradFlowCallback",
}


def _describe(metric: str, reports: Sequence[RunReport]) -> str:
    """Return what a run without ``metric`` is missing, and which callback would log it."""
    if metric in ("warnings", "notices"):
        return (
            "alarm counts <family>/alarms/<rule> or <family>/notices/<name> "
            "(GradFlowCallback(alarms=False)?)"
        )
    family, _, rule = metric.partition("/alarms/")
    noticed = notice_tag(rule, family)
    if rule and any(noticed in report.notices for report in reports):
        return f"{metric}: {rule} was a notice, logged and never warned, as {noticed}"
    full = dict(COLUMNS).get(metric, metric)
    callback = _CALLBACK.get(full.split("/")[0])
    return f"{full} (is {callback} in the Trainer?)" if callback else full


def _unknown(metric: str, reports: Sequence[RunReport]) -> str:
    """Return an unknown metric's message: the closest names, then every known one."""
    known = known_metrics()
    seen = {f for r in reports for row in r.layers for f in row.values if f not in known}
    names = [*known, *sorted(seen)]
    close = difflib.get_close_matches(metric, names, n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    return f"--fail-on: unknown metric {metric!r}{hint}; known: {', '.join(names)}"


def check(reports: Iterable[RunReport], rules: Sequence[FailRule]) -> list[str]:
    """Return every violation of every rule in every report.

    Args:
        reports: the runs read.
        rules: the ``--fail-on`` rules.

    Returns:
        One line per violation (see :meth:`FailRule.violations`), by report, then by rule.
    """
    return [line for report in reports for rule in rules for line in rule.violations(report)]


def _at_least_one(text: str) -> int:
    """Read ``--top``'s number of rows: a whole number of at least 1.

    Raises:
        argparse.ArgumentTypeError: it is not one; the message says what was received.
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected a whole number of rows, at least 1; got {text!r}"
        )
    return value


def _parser() -> argparse.ArgumentParser:
    """Build the command line's parser: the ``report`` command and its options."""
    parser = argparse.ArgumentParser(
        prog="lightning-hooks",
        description="Inspect lightning_hooks logs (TensorBoard event files or CSV logs).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser(
        "report",
        help="per-layer table of the last epoch of every run under LOGDIR, worst layer first",
        description="Per-layer table of the last logged epoch of every run under LOGDIR, worst "
        "layer first (non-finite gradients, dead fraction, update ratio far from 1e-3).",
    )
    report.add_argument(
        "logdir",
        metavar="LOGDIR",
        type=Path,
        help="a folder of runs: TensorBoard event files or Lightning's CSV logs (metrics.csv), "
        "symbolic links followed",
    )
    report.add_argument("--format", choices=("table", "json"), default="table")
    report.add_argument(
        "--top", type=_at_least_one, default=20, help="table rows per run (default 20)"
    )
    report.add_argument(
        "--fail-on",
        action="append",
        default=[],
        metavar="RULE",
        help="exit 1 if any layer or count matches RULE, e.g. 'grad_nonfinite>0', "
        "'dead_fraction>=0.9', 'warnings>0' (the alarms that warned; never the notices), "
        "repeatable, on the runs that logged its metric; exit 2 if RULE names an unknown "
        "metric or one no run logged",
    )
    return parser


def _error(message: str) -> int:
    """Print a usage error on standard error, and return its exit code."""
    print(f"lightning-hooks report: {message}", file=sys.stderr)
    return EXIT_USAGE


def _rules(texts: Sequence[str]) -> list[FailRule]:
    """Parse the ``--fail-on`` rules.

    One that names a metric by its 0.2.0 name reads the metric's new name, with a note on
    standard error.
    """
    rules = [FailRule.parse(text) for text in texts]
    for note in (rule.renamed() for rule in rules):
        if note is not None:
            print(f"lightning-hooks report: {note}", file=sys.stderr)
    return [replace(rule, metric=_OLD_NAMES.get(rule.metric, rule.metric)) for rule in rules]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line.

    Args:
        argv: the arguments after the program's name (``None``: ``sys.argv``'s).

    Returns:
        The exit code (also the process's, via ``sys.exit``): 0 all good, 1 a ``--fail-on`` rule
        was broken, 2 a usage error.
    """
    args = _parser().parse_args(argv)
    try:
        rules = _rules(args.fail_on)
    except ValueError as error:
        return _error(str(error))
    logdir: Path = args.logdir
    if not logdir.is_dir():
        return _error(f"{logdir}: no such directory")
    from tqdm import tqdm  # Lightning's own progress bar, on stderr after 1 s

    runs = tqdm(find_runs(logdir), "reading event files", unit="run", delay=1.0, file=sys.stderr)
    try:
        reports = [r for r in (read_run(run, logdir) for run in runs) if r is not None]
    except EventFileError as error:
        return _error(str(error))
    if not reports:
        return _error(
            f"no lightning_hooks events under {logdir} "
            "(expected TensorBoard event files with tags like grad_flow/grad_norm/<layer>)"
        )
    problems = [line for rule in rules for line in rule.problems(reports)]
    if problems:
        return _error("\n".join(problems))
    for line in (line for rule in rules for line in rule.unchecked(reports)):
        print(f"lightning-hooks report: {line}", file=sys.stderr)
    violations = check(reports, rules)
    if args.format == "json":
        payload = {"runs": [r.to_json() for r in reports], "violations": violations}
        text = json.dumps(payload, indent=2)
    else:
        text = "\n\n".join(format_table(r, args.top) for r in reports)
    _print(text)
    for line in violations:
        print(f"FAIL {line}", file=sys.stderr)
    return EXIT_FAILED if violations else EXIT_OK


def _print(text: str) -> None:
    """Print ``text`` to standard output; a reader that stops early (``| head``) ends it quietly."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python's advice: point stdout at devnull, so the flush at exit raises nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
