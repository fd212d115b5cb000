"""Every private attribute of torch, Lightning and TensorBoard the library uses is read in
``lightning_hooks/internals/`` and nowhere else; the torch floor is checked there at import; and
with the speed-ups off, the public paths log the same values."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from lightning_hooks import internals

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_hooks"
INTERNALS = PACKAGE / "internals"


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of an attribute chain rooted at a name, else ``None``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _private_torch_names(source: str) -> list[str]:
    """The private names of torch that ``source`` imports or reads."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            module = node.module or ""
            private = [a.name for a in node.names if a.name.startswith("_")]
            if "._" in f".{module}" or private:
                found.append(f"from {module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("torch") and "._" in a.name]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted and dotted.startswith("torch.") and "._" in dotted:
                found.append(dotted)
    return found


def test_the_scan_finds_each_form_of_a_private_name() -> None:
    source = (
        "import torch\nimport torch._dynamo\nfrom torch._C import _x\n"
        "from torch.nn.modules.module import _global_forward_hooks\n"
        "y = torch._foreach_norm\nz = torch.nn.functional.relu\n"
    )
    assert _private_torch_names(source) == [
        "torch._dynamo",
        "from torch._C import _x",
        "from torch.nn.modules.module import _global_forward_hooks",
        "torch._foreach_norm",
    ]


_NAMEDTUPLE = {"_fields", "_asdict", "_replace", "_make"}
"""The underscore names of ``collections.namedtuple``'s public API."""


def _private_reads_by_name(source: str) -> list[str]:
    """``getattr``, ``hasattr`` and ``setattr`` of a private attribute named by a literal (how
    another library's private attribute is read without its name in the code)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in ("getattr", "hasattr", "setattr") or len(node.args) < 2:
            continue
        name = node.args[1]
        if isinstance(name, ast.Constant) and isinstance(name.value, str):
            private = name.value.startswith("_") and not name.value.startswith("__")
            if private and name.value not in _NAMEDTUPLE:
                found.append(f"{node.func.id}(..., {name.value!r})")
    return found


def _outside_internals(scan: Callable[[str], list[str]]) -> dict[str, list[str]]:
    """What ``scan`` finds in each module of the package outside ``internals/``."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        names = [] if INTERNALS in path.parents else scan(path.read_text())
        if names:
            found[path.relative_to(PACKAGE.parent).as_posix()] = names
    return found


def test_no_module_but_internals_reads_a_private_attribute_by_name() -> None:
    assert _outside_internals(_private_reads_by_name) == {}
    assert _private_reads_by_name("getattr(scaler, '_scale', None)") == ["getattr(..., '_scale')"]


def test_no_module_but_internals_names_a_private_name_of_torch() -> None:
    assert _outside_internals(_private_torch_names) == {}
    assert _private_torch_names((INTERNALS / "__init__.py").read_text())  # where they are read


def test_a_torch_older_than_the_floor_fails_at_import_with_both_releases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "__version__", "2.3.1+cpu")
    with pytest.raises(ImportError, match=r"needs torch 2\.4 or newer; this is torch 2\.3\.1\+cpu"):
        importlib.reload(internals)
    monkeypatch.undo()
    importlib.reload(internals)
    assert internals.TORCH_VERSION >= internals.OLDEST_TORCH


_SWITCHED_FIT = """
import json, sys
import pytorch_lightning as pl
from pytorch_lightning.loggers import TensorBoardLogger
from tensorboard.summary.writer import record_writer
import lightning_hooks
from lightning_hooks.internals import tensorboard

sys.path.insert(0, "tests")
from conftest import TinyMLP

seen = {}


class Probe(pl.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        own = vars(trainer.callbacks[0]).items()
        seen["shadowed"] = sorted(k for k, v in own if v is None and k.startswith("on_"))

    def on_train_epoch_end(self, trainer, pl_module):
        writer = tensorboard._record_writer(trainer.logger.experiment)
        seen["patched"] = "write" in vars(writer)  # this logger's writer: checksums in C


pl.seed_everything(0, verbose=False)
trainer = pl.Trainer(
    max_epochs=2, accelerator="cpu", logger=TensorBoardLogger(sys.argv[1], name="tb", version=0),
    enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    log_every_n_steps=2, callbacks=[lightning_hooks.GradFlowCallback(), Probe()],
)
original = record_writer.masked_crc32c
trainer.fit(TinyMLP())
seen["module_untouched"] = record_writer.masked_crc32c is original
print(json.dumps(seen))
"""


def _switched_fit(root: Path, speedups: str) -> tuple[dict[str, object], dict[str, object]]:
    """A fit in a fresh process with ``LIGHTNING_HOOKS_SPEEDUPS=speedups``: what it saw, and
    its scalars read back from its event files."""
    import json
    import os
    import subprocess
    import sys

    from conftest import read_scalars

    env = {**os.environ, internals.SPEEDUPS_ENV: speedups, "PYTHONPATH": str(PACKAGE.parent)}
    done = subprocess.run(
        [sys.executable, "-c", _SWITCHED_FIT, str(root)],
        cwd=PACKAGE.parent,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(done.stdout.splitlines()[-1]), dict(read_scalars(root))


def test_with_the_speedups_off_the_public_paths_log_the_same_values(tmp_path: Path) -> None:
    on_seen, on = _switched_fit(tmp_path / "on", "1")
    off_seen, off = _switched_fit(tmp_path / "off", "0")
    assert on_seen["patched"] is True and off_seen["patched"] is False  # TensorBoard's checksums
    assert on_seen["module_untouched"] and off_seen["module_untouched"]
    assert on_seen["shadowed"] and off_seen["shadowed"] == []  # Lightning calls the empty hooks
    assert len(on) > 20
    assert on == off  # every scalar, step and value, bit for bit
