"""The ``lightning-hooks`` command: ``lightning-hooks report LOGDIR`` reads the runs back
(:mod:`lightning_hooks.report`) and checks its ``--fail-on`` rules against every run.

Exit codes: 0 all good, 1 a ``--fail-on`` rule was broken, 2 a usage error, including a rule
that cannot be checked, a corrupt event file or no events (a typo in a CI gate never passes)."""

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
from dataclasses import dataclass
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

__all__ = ["ALARMS", "LAYER_METRICS", "FailRule", "check", "known_metrics", "main"]

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

ALARMS: dict[str, tuple[str, ...]] = {
    "grad_flow": (
        *("spike", "explosion", "absolute", "vanishing", "nonfinite", "amp_overflow"),
        *("loss_spike", "diverging", "setback", "stall", "attention"),
    ),
}
"""Every ``family/alarms/rule`` count the library logs (``lightning_hooks.core.ALARM_RULES``, which
the CLI cannot import without torch: a test holds the two equal)."""

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
        or no run logged what it asks for. Empty when a run has it."""
        if any(_logged(report, self.metric) for report in reports):
            return []
        if self.metric not in known_metrics():
            return [_unknown(self.metric, reports)]
        return [f"no run logged {_describe(self.metric)} (rule {self.text!r})"]

    def unchecked(self, reports: Sequence[RunReport]) -> list[str]:
        """The runs the rule is not checked on: they never logged what it asks for (a folder of
        runs where only some had the callback that logs it)."""
        return [
            f"{report.run}: logged no {_describe(self.metric)}, not checked (rule {self.text!r})"
            for report in reports
            if not _logged(report, self.metric)
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
            value = report.alarms.get(self.metric, math.nan)
            return [f"{report.run}: {self.metric}={value:g}"] if test(value, self.threshold) else []
        return [
            f"{report.run}: {row.layer} {self.metric}={row.get(self.metric):.4g} ({name})"
            for row in report.layers
            if test(row.get(self.metric), self.threshold)
        ]


def known_metrics() -> list[str]:
    """Every metric a ``--fail-on`` rule may name: the columns, ``alarms``, each ``family/stat``,
    each alarm rule (the order a user who misspelt one reads them in)."""
    return [
        *(name for name, _ in COLUMNS),
        "alarms",
        *(f"{family}/{stat}" for family, stats in LAYER_METRICS.items() for stat in stats),
        *(f"{family}/alarms/{rule}" for family, rules in ALARMS.items() for rule in rules),
    ]


def _logged(report: RunReport, metric: str) -> bool:
    """Whether ``report`` holds ``metric`` (on any layer)."""
    if metric == "alarms":
        return bool(report.alarms)
    if "/alarms/" in metric:
        return metric in report.alarms
    full = dict(COLUMNS).get(metric, metric)
    return any(full in row.values for row in report.layers)


_CALLBACK = {
    **SHORT_NAMES,
    "activations": "ActivationStatsCallback",
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


def _parser() -> argparse.ArgumentParser:
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
    report.add_argument("--top", type=int, default=20, help="table rows per run (default 20)")
    report.add_argument(
        "--fail-on",
        action="append",
        default=[],
        metavar="RULE",
        help="exit 1 if any layer or alarm matches RULE, e.g. 'grad_nonfinite>0', "
        "'dead_fraction>=0.9', 'alarms>0' (repeatable), on the runs that logged its metric; "
        "exit 2 if RULE names an unknown metric or one no run logged",
    )
    return parser


def _error(message: str) -> int:
    print(f"lightning-hooks report: {message}", file=sys.stderr)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (also the process's, via ``sys.exit``)."""
    args = _parser().parse_args(argv)
    try:
        rules = [FailRule.parse(text) for text in args.fail_on]
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
    """``text`` to standard output; a reader that stops early (``| head``) ends it quietly."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python's advice: point stdout at devnull, so the flush at exit raises nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
