"""What importing the package costs: the core without Lightning, a CLI that answers at once.

Each check runs in a fresh interpreter: this test process has long imported everything.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lightning_hooks

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("lightning", "pytorch_lightning", "tensorboard", "matplotlib", "torch")


def _modules_after(statement: str) -> set[str]:
    """The top-level modules (and our subpackages) a fresh interpreter holds after ``statement``."""
    probe = f"import sys, json\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env
    ).stdout
    return set(json.loads(out.splitlines()[-1]))


@pytest.mark.parametrize(
    "statement",
    [
        "import lightning_hooks.core",
        "from lightning_hooks.core import HookRegistry, select_modules",
        "from lightning_hooks.core import LayerStat, ActivationStatsTracker, GradFlowTracker",
    ],
)
def test_core_imports_neither_lightning_nor_matplotlib_nor_tensorboard(statement: str) -> None:
    loaded = _modules_after(statement)
    assert "torch" in loaded  # the probe does see what was imported
    assert not {"lightning", "pytorch_lightning", "tensorboard", "matplotlib"} & loaded
    assert not {"lightning_hooks.callbacks", "lightning_hooks.logging"} & loaded


def test_core_names_resolve_lazily() -> None:
    from lightning_hooks import core

    assert "matplotlib" not in _modules_after("from lightning_hooks.core import LayerStat")
    for name in core.__all__:
        assert getattr(core, name) is getattr(importlib.import_module(core._LAZY[name]), name)
    renamed = {"SaturationStats": "SaturatedUnits"}  # 0.2.0's names, importable, not listed
    assert set(core._LAZY) == set(core.__all__) | set(renamed)
    for old, new in renamed.items():
        assert getattr(core, old) is getattr(core, new)
    assert set(core.__all__) <= set(dir(core))
    # A function named like its module stays the function, even once the module is imported.
    importlib.import_module("lightning_hooks.core.ops.feature_stats")
    assert callable(core.feature_stats) and callable(core.grad_stats)
    with pytest.raises(
        AttributeError, match=r"'lightning_hooks\.core' has no attribute 'HookRegstry'"
    ):
        _ = core.HookRegstry  # type: ignore[attr-defined]


def test_package_import_is_lazy_and_names_resolve() -> None:
    assert not set(HEAVY) & _modules_after("import lightning_hooks")
    loaded = _modules_after("from lightning_hooks import GradFlowCallback")
    assert {"pytorch_lightning", "lightning_hooks.callbacks.grad_flow"} <= loaded
    for name in lightning_hooks.__all__:
        assert getattr(lightning_hooks, name).__name__ == name
    assert set(lightning_hooks.__all__) <= set(dir(lightning_hooks))
    with pytest.raises(AttributeError, match="has no attribute 'GradFlowCalback'"):
        _ = lightning_hooks.GradFlowCalback  # type: ignore[attr-defined]


def test_cli_help_answers_in_under_a_second_without_torch() -> None:
    assert not set(HEAVY) & _modules_after(
        "from lightning_hooks.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "lightning_hooks.cli", "--help"]
    subprocess.run(command, capture_output=True, check=True, env=env)  # warm the file cache
    elapsed = float("inf")
    for _ in range(3):  # the best of three: one descheduling on a loaded machine is not the CLI
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
        elapsed = min(elapsed, time.perf_counter() - start)
        assert "report" in done.stdout
    assert elapsed < 1.0, f"lightning-hooks --help took {elapsed:.2f} s"
