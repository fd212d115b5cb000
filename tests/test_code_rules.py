"""The package's code rules: its contracts are kept in types, and the suppressed checks stay
within their bounds.

A module is bounded by what its functions do, not by its lines: ruff's complexity rules (C901 at
``max-complexity = 10`` and PLR0915, in ``pyproject.toml``) bound each function, and a module
that holds too much is split along a seam a reader can see."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_hooks"


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


SUPPRESSED = {"SLF001": 10, "ANN401": 40, "PLR0913": 20}
"""At most this many of each, each with its ``noqa`` and reason: a private member read across
objects, an ``Any`` in a signature, a function of more than five arguments (the callbacks' and
the statistics' public constructors, and ``add_layer_state`` as torchmetrics' ``add_state``, one
keyword per option; the selection check every per-layer callback's ``on_fit_start`` makes; the
alarms' update, the gradient rules' ``evaluate`` and the feed's ``observe`` on the quiet step's
path, where no record is built per step; ``FitAlarms``, made of one fit's parts; signatures that
mirror torch or Triton)."""


def test_the_contracts_in_types_stay_within_their_bounds() -> None:
    """ruff's diagnostics over the package with every ``noqa`` ignored: what is suppressed
    counts too."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is in the dev extra")
    done = subprocess.run(
        [ruff, "check", str(PACKAGE), "--select", ",".join(SUPPRESSED), "--ignore-noqa",
         "--output-format", "json", "--exit-zero"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = Counter(d["code"] for d in json.loads(done.stdout))
    over = {code: n for code, n in found.items() if n > SUPPRESSED[code]}
    assert not over, f"over the bound {SUPPRESSED}: {dict(found)}"
    noqa = re.compile(r"# noqa: (SLF001|ANN401|PLR0913)(?! \()")
    bare = [str(p) for p in _modules() if noqa.search(p.read_text())]
    assert not bare, f"a noqa without its reason in {bare}"


PROTOCOL_MEMBERS = 5
"""The most members a protocol declares itself; a larger contract is made of small ones, each
the part some caller reads (``TrainerView`` of ``FitProgress``, ``TrainingSetup`` and
``GradientSettings``)."""


def _is_protocol(node: ast.ClassDef) -> bool:
    """Whether ``node`` derives from ``Protocol`` or ``Protocol[...]`` directly."""
    for base in node.bases:
        named = base.value if isinstance(base, ast.Subscript) else base
        if isinstance(named, ast.Name) and named.id == "Protocol":
            return True
    return False


def test_every_protocol_is_a_small_contract() -> None:
    """No protocol declares more than five members of its own: methods, properties and
    attributes."""
    large = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and _is_protocol(node):
                own = [
                    member
                    for member in node.body
                    if isinstance(member, ast.FunctionDef | ast.AnnAssign)
                ]
                if len(own) > PROTOCOL_MEMBERS:
                    large[f"{_name(path)}:{node.name}"] = len(own)
    assert large == {}


def test_the_package_is_held_to_the_docstring_rules() -> None:
    """pydocstyle's rules (Google convention) hold for every module of the package, whose
    docstrings the reference pages render, and not for the tests."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is in the dev extra")
    fragment = '"""A module."""\n\n\ndef public(value: int) -> int:\n    """a fragment"""\n'
    codes: dict[str, set[str]] = {}
    for where in ("callbacks/_probe.py", "core/_probe.py", "../tests/_probe.py"):
        path = str((PACKAGE / where).resolve())
        done = subprocess.run(
            [ruff, "check", "--stdin-filename", path, "--output-format", "json",
             "--exit-zero", "-"],
            input=fragment, capture_output=True, text=True, check=True, cwd=PACKAGE.parent,
        )  # fmt: skip
        codes[where] = {d["code"] for d in json.loads(done.stdout)}
    assert {"D403", "D415"} <= codes["callbacks/_probe.py"], codes
    assert {"D403", "D415"} <= codes["core/_probe.py"], codes
    assert not any(code.startswith("D") for code in codes["../tests/_probe.py"]), codes


def _assignments() -> Counter[str]:
    """The package's chained assignments, tuple-to-tuple assignments and assignment expressions."""
    found: Counter[str] = Counter()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and len(node.targets) > 1:
                found["chained"] += 1
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
                found["tuple"] += isinstance(node.targets[0], ast.Tuple)
            elif isinstance(node, ast.NamedExpr):
                found["walrus"] += 1
    return found


def test_one_statement_a_line() -> None:
    """No chained assignment; a tuple assignment only for a swap (at most 10); at most 5
    assignment expressions: the code reads one statement a line, as the anchors do."""
    found = _assignments()
    assert found["chained"] == 0, found
    assert found["tuple"] <= 10, found
    assert found["walrus"] <= 5, found
