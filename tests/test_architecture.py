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


def _callback_classes() -> list[type]:
    """Every callback class of the library (the base and its subclasses)."""
    from lightning_hooks.callbacks.base import HookCallback

    found: list[type] = []
    queue: list[type] = [HookCallback]
    while queue:
        cls = queue.pop()
        found.append(cls)
        queue.extend(cls.__subclasses__())
    return [cls for cls in found if cls.__module__.startswith("lightning_hooks.")]


def _calls_parent_init(cls: type) -> bool:
    """Whether ``cls.__init__`` calls ``super().__init__(...)``."""
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(cls.__dict__["__init__"]))
    for node in ast.walk(ast.parse(source)):
        called = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        if called and node.func.attr == "__init__":
            target = node.func.value
            if isinstance(target, ast.Call) and getattr(target.func, "id", "") == "super":
                return not target.args  # super() itself: no super(Grandparent, self)
    return False


def test_every_callback_keeps_its_parents_constructor_contract() -> None:
    """Each callback's ``__init__`` calls its parent's, with a plain ``super()``: the state a
    fit starts from is declared once, in the base's ``__init__``."""
    classes = _callback_classes()
    assert len(classes) >= 8, classes
    own = [cls for cls in classes if "__init__" in cls.__dict__]
    assert [cls.__name__ for cls in own if not _calls_parent_init(cls)] == []


def test_no_callback_skips_a_parent_with_super_of_a_grandparent() -> None:
    root = CORE.parent / "callbacks"
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "super":
                assert not node.args, f"{path.name}:{node.lineno}: super() with arguments"
