"""GradFlowCallback under Fabric's DDP on 2 CPU processes logs what one process logs on the
global batch (every per-layer statistic at every logging step and the epoch's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import read_scalars, run_script


def _one_process(out: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    script = root / "tests" / "fabric_ddp_run.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--out", str(out), "--devices", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_fabric_ddp_logs_what_one_process_logs(tmp_path: Path) -> None:
    run_script("fabric_ddp_run.py", tmp_path / "ddp")
    _one_process(tmp_path / "one")
    ddp, one = read_scalars(tmp_path / "ddp" / "tb"), read_scalars(tmp_path / "one" / "tb")
    assert set(ddp) == set(one)
    compared = [t for t in one if t.startswith("grad_flow/") and "/alarms" not in t]
    assert "grad_flow/grad_norm_preclip_step/0" in compared
    assert "grad_flow/output_grad_norm_step/2" in compared
    for tag in compared:
        assert (
            [s for s, _ in ddp[tag]] == [s for s, _ in one[tag]] == sorted({s for s, _ in one[tag]})
        )
        for (_, got), (_, want) in zip(ddp[tag], one[tag], strict=True):
            assert got == pytest.approx(want, rel=1e-4, abs=1e-7), tag
