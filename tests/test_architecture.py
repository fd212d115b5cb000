"""The layer diagram of docs/architecture.md is the package's real import graph.

Every edge drawn there (``a --> b``: something in ``a`` imports something in ``b``) is found in
the code, and every import between two units of the package is drawn: a new dependency, or one
that goes away, fails here until the picture is redrawn. The graph has no cycle, and the core
(``core`` and below) imports nothing of Lightning, matplotlib or TensorBoard.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_hooks"
DOC = ROOT / "docs" / "architecture.md"
CORE_SUBPACKAGES = ("alarms", "hooks", "kernels", "stats", "transport")
NOT_IN_CORE = ("lightning", "pytorch_lightning", "matplotlib", "tensorboard")


def unit_of(module: str) -> str | None:
    """The diagram's node for a ``lightning_hooks`` module (None: not one of ours)."""
    parts = module.split(".")
    if parts[0] != "lightning_hooks":
        return None
    if len(parts) == 1 or parts[1] == "_lazy":
        return None  # the package facade and its lazy loader are plumbing, not layers
    if parts[1] != "core":
        return parts[1]
    if len(parts) > 2 and (parts[2] in CORE_SUBPACKAGES or parts[2] == "checks"):
        return f"core.{parts[2]}"
    return "core"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST) -> list[str]:
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module in ("lightning_hooks", "lightning_hooks.core"):
                found += [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


def code_edges() -> set[tuple[str, str]]:
    """``(a, b)`` for every import from unit ``a`` to another unit ``b`` of the package."""
    edges: set[tuple[str, str]] = set()
    for path in PACKAGE.rglob("*.py"):
        source = unit_of(_module_name(path))
        if source is None:
            continue
        for imported in _imports(ast.parse(path.read_text())):
            target = unit_of(imported)
            if target is not None and target != source:
                edges.add((source, target))
    return edges


def drawn_edges() -> set[tuple[str, str]]:
    block = DOC.read_text().split("```mermaid", 1)[1].split("```", 1)[0]
    edges = re.findall(r"^\s*([\w.]+)\s*-->\s*([\w.]+)\s*$", block, flags=re.MULTILINE)
    return {(_node(a), _node(b)) for a, b in edges}


def _node(mermaid_id: str) -> str:
    """``core_stats`` -> ``core.stats`` (a mermaid id cannot hold a dot); others as written."""
    return re.sub(r"^core_", "core.", mermaid_id)


def test_the_diagram_is_the_import_graph() -> None:
    code, drawn = code_edges(), drawn_edges()
    assert drawn, "no edge found in the mermaid block of docs/architecture.md"
    assert sorted(code - drawn) == [], "imports the diagram does not draw"
    assert sorted(drawn - code) == [], "edges drawn that the code does not have"


def test_the_import_graph_has_no_cycle() -> None:
    edges = code_edges()
    nodes = {n for edge in edges for n in edge}
    remaining = set(nodes)
    while remaining:
        leaves = {n for n in remaining if not any(a == n and b in remaining for a, b in edges)}
        assert leaves, f"a cycle among {sorted(remaining)}"
        remaining -= leaves


@pytest.mark.parametrize("path", sorted((PACKAGE / "core").rglob("*.py")), ids=str)
def test_the_core_imports_no_framework(path: Path) -> None:
    tops = {name.split(".")[0] for name in _imports(ast.parse(path.read_text()))}
    assert not tops & set(NOT_IN_CORE), f"{path} imports {sorted(tops & set(NOT_IN_CORE))}"


def test_every_core_subpackage_says_what_lives_there() -> None:
    for name in CORE_SUBPACKAGES:
        doc = ast.get_docstring(ast.parse((PACKAGE / "core" / name / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()) == 1, name
