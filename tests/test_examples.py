"""The short examples run as a user runs them: a fresh interpreter, in an empty directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import read_image_tags, read_scalars

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_quickstart_logs_the_dashboard(tmp_path: Path) -> None:
    out = _run("quickstart.py", tmp_path)
    assert out.strip().endswith("tensorboard --logdir runs")
    run = tmp_path / "runs" / "quickstart"
    scalars = read_scalars(run)
    assert {f"grad_flow/grad_norm/net.{i}" for i in (0, 2, 4)} <= set(scalars)
    assert [step for step, _ in scalars["grad_flow/global/grad_norm"]] == [16, 32, 48]
    assert read_image_tags(run) == ["grad_flow/chart"]


def test_plain_loop_measures_without_lightning(tmp_path: Path) -> None:
    lines = _run("plain_loop.py", tmp_path).splitlines()
    assert [line.split(":")[0] for line in lines] == ["epoch 0", "epoch 1", "epoch 2"]
    for line in lines:
        ratio = float(line.split("update ratio ")[1].split(";")[0])
        assert 0 < ratio < 1
    assert not (tmp_path / "runs").exists()
