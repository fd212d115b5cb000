"""LIGHTNING_HOOKS: the entry points of the installed package, found by Lightning's own loader
(a ``pip install --no-deps --target`` of this repository in a temporary folder)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_hooks import DeadReLUCallback, GradFlowCallback
from lightning_hooks.entry_points import SHORT_NAMES, callbacks, requested

_GROUPS = [
    f"{namespace}.callbacks_factory"
    for namespace in (
        "pytorch_lightning",
        "lightning.pytorch",
        "lightning_fabric",
        "lightning.fabric",
    )
]
_PROBE = f"""
import json
from lightning_fabric.utilities.registry import _load_external_callbacks
print(json.dumps({{g: [type(c).__name__ for c in _load_external_callbacks(g)] for g in {_GROUPS}}}))
"""


def test_installed_entry_points_found_by_lightning(tmp_path: Path) -> None:
    root = tmp_path / "repo"  # a copy: the build's egg-info stays out of the checkout
    source = Path(__file__).resolve().parent.parent
    shutil.copytree(source / "lightning_hooks", root / "lightning_hooks")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(source / name, root / name)
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(root),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    run = [sys.executable, "-c", _PROBE]
    off = subprocess.run(run, env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert json.loads(off.stdout) == {group: [] for group in _GROUPS}
    env["LIGHTNING_HOOKS"] = "grad_flow,dead_relu"
    on = subprocess.run(run, env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    found = json.loads(on.stdout)
    assert found == {group: ["GradFlowCallback", "DeadReLUCallback"] for group in _GROUPS}
    env["LIGHTNING_HOOKS"] = "grad_flw"
    bad = subprocess.run(run, env=env, cwd=tmp_path, capture_output=True, text=True, check=False)
    assert bad.returncode != 0
    assert "'grad_flw' is no callback; allowed (comma-separated): all, grad_flow" in bad.stderr


def test_unset_or_empty_adds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIGHTNING_HOOKS", raising=False)
    assert callbacks() == []
    monkeypatch.setenv("LIGHTNING_HOOKS", " ")
    assert callbacks() == []


def test_names_short_class_and_all() -> None:
    assert requested("GradFlowCallback,grad_flow") == ["GradFlowCallback"]
    assert "GradFlowCallback" in requested("all")
    with pytest.raises(ValueError, match=r"LIGHTNING_HOOKS='x': 'x' is no callback.*GradFlow"):
        requested("x")


def test_trainer_does_not_add_a_callback_twice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The user's GradFlowCallback runs; the one LIGHTNING_HOOKS added stands down (attaches
    nothing), the DeadReLUCallback it added runs."""
    from conftest import TinyMLP, make_trainer

    monkeypatch.setenv("LIGHTNING_HOOKS", "grad_flow,dead_relu")
    added = callbacks()  # what the entry point gives (the checkout itself is not installed)
    monkeypatch.delenv("LIGHTNING_HOOKS")
    mine = GradFlowCallback()
    trainer = make_trainer(tmp_path, callbacks=[mine, *added], max_steps=2)
    trainer.fit(TinyMLP())
    watching = [cb for cb in [mine, *added] if cb.lifecycle.watching]
    assert watching == [mine, added[1]]
    assert isinstance(added[1], DeadReLUCallback)


def test_a_key_read_before_the_switch_marks_the_callback_is_not_kept() -> None:
    """The checkpoint key follows the mark, whenever it was read: a key read first (a logger's
    hyperparameters, a profiler) does not stay the user's callback's key."""
    added = GradFlowCallback()
    users_key = added.state_key
    added.mark_from_environment()
    assert added.from_environment
    assert added.state_key != users_key
    assert added.state_key == GradFlowCallback()._generate_state_key(
        types="None", include=(), exclude=(), environment=True
    )


@pytest.mark.parametrize("short", sorted(SHORT_NAMES))
def test_the_users_own_callback_beside_the_one_the_switch_adds(
    short: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Lightning refuses two callbacks with one checkpoint key: each callback the switch adds has
    a key of its own, so the Trainer builds, and only the user's watches the fit."""
    import lightning_hooks

    from conftest import BoundedMLP, make_trainer

    monkeypatch.setenv("LIGHTNING_HOOKS", short)
    (added,) = callbacks()
    monkeypatch.delenv("LIGHTNING_HOOKS")
    mine = getattr(lightning_hooks, SHORT_NAMES[short])()
    assert added.state_key != mine.state_key
    trainer = make_trainer(tmp_path, callbacks=[mine, added], max_steps=2)
    trainer.fit(BoundedMLP())
    assert [cb for cb in (mine, added) if cb.lifecycle.watching] == [mine]


def test_fabric_does_not_add_a_callback_twice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.loggers import TensorBoardLogger
    from torch import nn

    monkeypatch.setenv("LIGHTNING_HOOKS", "grad_flow")
    added = callbacks()
    monkeypatch.delenv("LIGHTNING_HOOKS")
    mine = GradFlowCallback()
    fabric = Fabric(
        accelerator="cpu",
        devices=1,
        callbacks=[mine, *added],
        loggers=[TensorBoardLogger(str(tmp_path))],
    )
    model = nn.Linear(4, 1)
    fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    runs = [cb for cb in fabric._callbacks if type(cb).__name__ == "FabricRun"]
    assert [run.callback for run in runs] == [mine]
    # The added callback gave way, and left Fabric's list: the loop's documented calls reach
    # only the run, never a Trainer hook with Fabric's arguments.
    assert not [cb for cb in fabric._callbacks if isinstance(cb, GradFlowCallback)]
    fabric.call("on_before_backward", model(torch.randn(2, 4)).sum())
    fabric.call("on_train_epoch_end")
    fabric.call("on_train_end")
