"""``benchmarks/overhead.py`` writes the tracked results only when asked (``--save``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _overhead() -> ModuleType:
    spec = importlib.util.spec_from_file_location("overhead", ROOT / "benchmarks" / "overhead.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["overhead"] = module
    spec.loader.exec_module(module)
    return module


def test_results_are_written_only_with_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    overhead = _overhead()
    assert not overhead.parse_args(["--quick"]).save
    assert overhead.parse_args([]).out == str(ROOT / "benchmarks" / "results" / "overhead")
    monkeypatch.setattr(overhead, "markdown", lambda results: "| table |\n")
    monkeypatch.setattr(overhead, "time_rounds", lambda *a: {})
    monkeypatch.setattr(overhead, "measures", lambda *a: {})
    out = tmp_path / "results" / "overhead"
    overhead.main(["--models", "mlp", "--depths", "--sample-every", "--out", str(out)])
    assert not out.parent.exists()
    assert "not saved: add --save" in capsys.readouterr().err
    overhead.main(["--models", "mlp", "--depths", "--sample-every", "--out", str(out), "--save"])
    assert out.with_suffix(".md").read_text() == "| table |\n"
    assert '"command"' in out.with_suffix(".json").read_text()
