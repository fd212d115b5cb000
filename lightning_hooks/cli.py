"""The ``lightning-hooks`` command: ``lightning-hooks report LOGDIR`` reads the event files back.

Exit codes: 0 all good, 1 a ``--fail-on`` rule was broken, 2 a rule that cannot be checked (an
unknown metric, a run that never logged it), a corrupt or truncated event file, no events, or
another usage error. It fails closed: a typo in a CI gate is an error, never a pass.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_hooks.report import (
    EventFileError,
    FailRule,
    RunReport,
    check,
    find_runs,
    format_table,
    read_run,
)

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-hooks", description="Inspect lightning_hooks TensorBoard logs."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    report = commands.add_parser(
        "report",
        help="per-layer table of the last epoch of every run under LOGDIR, worst layer first",
        description="Per-layer table of the last logged epoch of every run under LOGDIR, worst "
        "layer first (non-finite gradients, dead fraction, update ratio far from 1e-3).",
    )
    report.add_argument("logdir", metavar="LOGDIR", type=Path, help="a TensorBoard log directory")
    report.add_argument("--format", choices=("table", "json"), default="table")
    report.add_argument("--top", type=int, default=20, help="table rows per run (default 20)")
    report.add_argument(
        "--fail-on",
        action="append",
        default=[],
        metavar="RULE",
        help="exit 1 if any layer or alarm matches RULE, e.g. 'grad_nonfinite>0', "
        "'dead_fraction>=0.9', 'alarms>0' (repeatable); exit 2 if RULE names an unknown metric "
        "or one a run never logged",
    )
    return parser


def _error(message: str) -> int:
    print(f"lightning-hooks report: {message}", file=sys.stderr)
    return EXIT_USAGE


def _read(logdir: Path) -> list[RunReport]:
    """Every run under ``logdir`` with library tags; a progress bar on stderr after 1 s."""
    from tqdm import tqdm  # Lightning's own progress bar: already installed

    runs = find_runs(logdir)
    progress = tqdm(runs, desc="reading event files", unit="run", delay=1.0, file=sys.stderr)
    return [r for r in (read_run(run, logdir) for run in progress) if r is not None]


def _report(args: argparse.Namespace) -> int:
    try:
        rules = [FailRule.parse(text) for text in args.fail_on]
    except ValueError as error:
        return _error(str(error))
    logdir: Path = args.logdir
    if not logdir.is_dir():
        return _error(f"{logdir}: no such directory")
    try:
        reports = _read(logdir)
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
    violations = check(reports, rules)
    if args.format == "json":
        payload = {"runs": [r.to_json() for r in reports], "violations": violations}
        print(json.dumps(payload, indent=2))
    else:
        print("\n\n".join(format_table(r, args.top) for r in reports))
    for line in violations:
        print(f"FAIL {line}", file=sys.stderr)
    return EXIT_FAILED if violations else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (also the process's, via ``sys.exit``)."""
    args = _parser().parse_args(argv)
    return _report(args)


if __name__ == "__main__":
    sys.exit(main())
