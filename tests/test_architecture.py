"""What the architecture contract (``[tool.importlinter]``, checked by ``lint-imports`` in
``./dev test``) cannot say: every folder of the core says in one line what lives there."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "lightning_hooks" / "core"


@pytest.mark.parametrize("init", sorted(CORE.glob("*/__init__.py")), ids=lambda p: p.parent.name)
def test_every_core_subpackage_says_what_lives_there(init: Path) -> None:
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and len(doc.splitlines()) == 1, init
