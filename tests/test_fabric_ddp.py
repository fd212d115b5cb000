"""GradFlowCallback under Fabric's DDP on 2 CPU processes logs what one process logs on the
global batch (every per-layer statistic at every logging step and the epoch's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import read_scalars, run_script


def test_fabric_ddp_logs_what_one_process_logs(tmp_path: Path) -> None:
    run_script("fabric_ddp_run.py", tmp_path / "ddp")
    run_script("fabric_ddp_run.py", tmp_path / "one", "--devices", "1")
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
