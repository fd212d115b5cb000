"""The release: one version in ``pyproject.toml``, ``lightning_hooks.__version__`` and the
CHANGELOG's latest release, and a wheel of the tree that installs into a fresh virtual
environment where its command and its entry points work."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path
from typing import Any

import pytest

import lightning_hooks

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parent.parent
PROJECT: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_version_is_the_changelogs_latest_release() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\](.*)$", changelog, flags=re.MULTILINE)
    assert headings[0] == ("Unreleased", ""), headings[:2]
    latest, date = headings[1]
    assert re.fullmatch(r" - \d{4}-\d{2}-\d{2}", date), date
    assert PROJECT["version"] == latest
    assert lightning_hooks.__version__ == latest


_PROBE = """
import importlib.metadata as md, json, sys
import lightning_hooks
groups = json.loads(sys.argv[1])
found = {}
for group in groups:
    (point,) = [p for p in md.entry_points(group=group) if p.dist.name == "lightning-hooks"]
    found[group] = [type(c).__name__ for c in point.load()()]
print(json.dumps({
    "version": md.version("lightning-hooks"),
    "module": lightning_hooks.__version__,
    "file": lightning_hooks.__file__,
    "found": found,
}))
"""


def _fresh_venv(path: Path) -> Path:
    """A new virtual environment that also sees this interpreter's packages (torch, Lightning)
    through a ``.pth`` line placed after its own site-packages: nothing is downloaded, and what
    the wheel installs there is found first."""
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(path)
    python = path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_the_wheel_installs_and_its_command_and_entry_points_work(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: the build leaves its egg-info outside the checkout
    shutil.copytree(ROOT / "lightning_hooks", source / "lightning_hooks")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    flags = ["--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run([*pip, "wheel", *flags, "-w", tmp_path, source], check=True, timeout=120)
    (wheel,) = tmp_path.glob("lightning_hooks-*.whl")
    assert wheel.name.startswith(f"lightning_hooks-{PROJECT['version']}-")

    python = _fresh_venv(tmp_path / "venv")
    subprocess.run([*pip, "--python", python, "install", *flags, wheel], check=True, timeout=120)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LIGHTNING_HOOKS")}
    for script in PROJECT["scripts"]:
        done = subprocess.run(
            [python.parent / script, "--help"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert "usage:" in done.stdout

    groups = list(PROJECT["entry-points"])
    env["LIGHTNING_HOOKS"] = "grad_flow,dead_relu"
    probe = subprocess.run(
        [python, "-c", _PROBE, json.dumps(groups)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert probe.returncode == 0, probe.stderr
    seen = json.loads(probe.stdout)
    assert seen["version"] == seen["module"] == PROJECT["version"]
    assert Path(seen["file"]).is_relative_to(tmp_path / "venv")
    assert seen["found"] == {group: ["GradFlowCallback", "DeadReLUCallback"] for group in groups}
