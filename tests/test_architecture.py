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


OWN_HOOKS = (
    "on_fit_start",
    "on_train_start",
    "on_train_batch_start",
    "on_train_batch_end",
    "on_train_epoch_end",
)
"""The Lightning hooks each callback defines for what it measures, calling its lifecycle."""


def _members_of_the_base() -> set[str]:
    """What the base offers its callbacks: its own members and those of the classes of ours it
    derives from (Fabric's entry points, ``FabricHooks``)."""
    from lightning_hooks.callbacks.base import HookCallback

    ours = [c for c in HookCallback.__mro__ if c.__module__.startswith("lightning_hooks.")]
    return {name for c in ours for name in vars(c) if not name.startswith(("__", "_abc_"))}


def test_each_callback_defines_its_own_hooks_and_overrides_nothing_of_the_base() -> None:
    """Each callback reads top to bottom: it defines the Lightning hooks of what it measures,
    overrides no member of the base, and calls no method of the base with ``super()`` but its
    constructor."""
    import inspect
    import textwrap

    from lightning_hooks.callbacks.base import HookCallback

    base = _members_of_the_base()
    for cls in _callback_classes():
        if cls is HookCallback:
            continue
        own = {name for name in vars(cls) if not name.startswith(("__", "_abc_"))}
        assert set(OWN_HOOKS) <= own, (cls.__name__, sorted(set(OWN_HOOKS) - own))
        assert not own & base, (cls.__name__, sorted(own & base))
        source = textwrap.dedent(inspect.getsource(cls))
        for node in ast.walk(ast.parse(source)):
            called = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if called and isinstance(node.func.value, ast.Call):
                chained = getattr(node.func.value.func, "id", "") == "super"
                assert not chained or node.func.attr == "__init__", (cls.__name__, node.func.attr)


def _does_nothing(statement: ast.stmt) -> bool:
    """Whether ``statement`` does nothing: ``pass``, ``...``, a string, or a constant returned."""
    if isinstance(statement, ast.Pass):
        return True
    if isinstance(statement, ast.Expr):
        return isinstance(statement.value, ast.Constant)
    if isinstance(statement, ast.Return):
        return statement.value is None or isinstance(statement.value, ast.Constant)
    return False


def _is_extension_point(method: ast.FunctionDef) -> bool:
    """Whether a method of the base is there for a subclass to write: abstract, one that raises
    ``NotImplementedError``, or a default that does nothing (a docstring, ``pass``, ``...`` or a
    constant returned)."""
    abstract = any(getattr(d, "id", "") == "abstractmethod" for d in method.decorator_list)
    raises = any(
        isinstance(node, ast.Raise) and "NotImplementedError" in ast.unparse(node)
        for node in ast.walk(method)
    )
    return abstract or raises or all(_does_nothing(statement) for statement in method.body)


_TEMPLATE_HOOKS = (
    "def hook(self):\n    pass",
    "def hook(self):\n    ...",
    "def hook(self):\n    'Override me.'",
    "def hook(self):\n    'Override me.'\n    return None",
    "def hook(self):\n    raise NotImplementedError",
    "@abstractmethod\ndef hook(self):\n    'Override me.'\n    x = 1",
)


@pytest.mark.parametrize("source", _TEMPLATE_HOOKS)
def test_each_form_of_a_templates_hook_is_an_extension_point(source: str) -> None:
    """The check the base is held to catches each form a template's hook takes."""
    (method,) = ast.parse(source).body
    assert isinstance(method, ast.FunctionDef)
    assert _is_extension_point(method)


def test_a_method_that_works_is_not_an_extension_point() -> None:
    (method,) = ast.parse("def hook(self):\n    'Work.'\n    self.lifecycle.flush(1)").body
    assert isinstance(method, ast.FunctionDef)
    assert not _is_extension_point(method)


def test_the_base_has_no_extension_point_and_calls_only_its_own_methods() -> None:
    """The base is no template: it has no abstract method nor documented no-op for a callback
    to fill, and every method it calls on ``self`` is its own, or Lightning's."""
    import inspect

    import pytorch_lightning as pl

    from lightning_hooks.callbacks.base import HookCallback

    tree = ast.parse(inspect.getsource(HookCallback))
    (base,) = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    methods = [node for node in base.body if isinstance(node, ast.FunctionDef)]
    assert [m.name for m in methods if _is_extension_point(m)] == []
    known = _members_of_the_base() | set(vars(pl.Callback))
    called = {
        node.func.attr
        for node in ast.walk(base)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and getattr(node.func.value, "id", "") == "self"
    }
    assert called <= known, sorted(called - known)


def test_the_callbacks_define_no_method_for_the_type_checker_alone() -> None:
    """A method a reader sees in a callback's class exists at run time: none is defined under
    ``if TYPE_CHECKING:``."""
    for path in sorted((CORE.parent / "callbacks").glob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in cls.body:
                hidden = (
                    isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
                )
                assert not hidden, f"{path.name}:{node.lineno}: {cls.name} under TYPE_CHECKING"


def test_fabric_holds_its_entry_points() -> None:
    """The base defines no method Fabric calls by name: those are ``FabricHooks``'
    (``callbacks/fabric.py``), which the base derives from, so every callback still answers
    Fabric; the run they start is ``callbacks/fabric_run.py``'s."""
    from lightning_hooks.callbacks.base import HookCallback
    from lightning_hooks.callbacks.fabric import FabricHooks

    fabric_entry_points = {"on_after_setup", "on_after_optimizer_step", "release"}
    assert not fabric_entry_points & set(vars(HookCallback))
    assert fabric_entry_points <= set(vars(FabricHooks))
    assert issubclass(HookCallback, FabricHooks)


_MUTATORS = {"append", "add", "update", "clear", "setdefault", "pop", "insert", "remove"}

REGISTRIES = {
    "core/hooks/selection.py": {"_SEEN"},
    "core/hooks/shared.py": {"_MODELS"},
    "logging/__init__.py": {"_KINDS", "_SINKS"},
}
"""The module-level state the package keeps, each because it outlives a fit or spans the
callbacks: a cache keyed by class, one share of each model's hooks, and the loggers' sinks with
the kinds that make them."""


def _mutated_module_names(path: Path) -> set[str]:
    """The module-level names of ``path`` that its code mutates (an item set or a mutator
    called)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if node.func.attr in _MUTATORS and isinstance(owner, ast.Name) and owner.id in names:
                found.add(owner.id)
        if isinstance(node, ast.Assign | ast.Delete):
            for target in node.targets:
                item = isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                if item and target.value.id in names:  # type: ignore[union-attr]
                    found.add(target.value.id)  # type: ignore[union-attr]
    return found


def test_module_level_state_is_the_few_registries_that_outlive_a_fit() -> None:
    """State of one fit belongs to an object the fit owns: the package mutates only the
    module-level registries listed, and each says why it is one in its docstring."""
    package = CORE.parent
    found = {}
    for path in sorted(package.rglob("*.py")):
        names = _mutated_module_names(path)
        if names:
            found[path.relative_to(package).as_posix()] = names
    assert found == REGISTRIES
    for module, names in REGISTRIES.items():
        tree = ast.parse((package / module).read_text())
        for i, node in enumerate(tree.body):
            target = getattr(node, "target", None)
            if isinstance(target, ast.Name) and target.id in names:
                following = tree.body[i + 1]
                documented = isinstance(following, ast.Expr) and isinstance(
                    following.value, ast.Constant
                )
                assert documented, f"{module}: {target.id} has no docstring"


def test_every_lightning_hook_a_callback_defines_runs_under_its_guard() -> None:
    """Our failure is never the user's: each Lightning hook of a callback is decorated with
    ``guarded``, visibly, where it is defined."""
    from lightning_hooks.core.hooks.guard import GUARDED_HOOKS, RELEASE_HOOKS

    for cls in _callback_classes():
        for name in (*GUARDED_HOOKS, *RELEASE_HOOKS):
            method = vars(cls).get(name)
            if method is not None:
                assert getattr(method, "lightning_hooks_guarded", False), (cls.__name__, name)


def _reads_of_the_callback_list(tree: ast.AST) -> set[str]:
    """Return each read of a list of callbacks in ``tree``: ``.callbacks``, ``fabric_callbacks``."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "callbacks":
            found.add(ast.unparse(node))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "fabric_callbacks":
            found.add(ast.unparse(node))
    return found


def test_a_callback_reads_the_list_of_callbacks_only_to_give_way_to_the_users_own() -> None:
    """A callback never finds another by scanning the Trainer's callbacks. It reads the list in
    one place, under each loop: a callback the ``LIGHTNING_HOOKS`` switch added gives way to one
    of its class that the user passed (``defers_to_users_own``, at ``setup`` and at
    ``fabric.setup``). The Fabric loop's stand-in Trainer holds its one callback in a list of
    its own, as the Trainer does."""
    package = CORE.parent
    readers = {}
    for path in sorted(package.rglob("*.py")):
        reads = _reads_of_the_callback_list(ast.parse(path.read_text()))
        if reads:
            readers[path.relative_to(package).as_posix()] = reads
    assert readers == {
        "callbacks/base.py": {"trainer.callbacks"},
        "callbacks/fabric_run.py": {"fabric_callbacks(fabric)", "self.callbacks"},
    }
