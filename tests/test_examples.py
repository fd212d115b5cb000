"""The short examples run as scripts (``__main__``) in an empty working directory."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from conftest import epoch_end_step, read_image_tags, read_scalars

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(script: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # In-process: a fresh interpreter would spend most of the test importing torch again.
    monkeypatch.chdir(cwd)
    monkeypatch.syspath_prepend(str(EXAMPLES))  # as `python examples/x.py` puts it first
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")


def test_quickstart_logs_the_dashboard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _run("quickstart.py", tmp_path, monkeypatch)
    assert capsys.readouterr().out.strip().endswith("tensorboard --logdir runs")
    run = tmp_path / "runs" / "quickstart"
    scalars = read_scalars(run)
    assert {f"grad_flow/grad_norm/net.{i}" for i in (0, 2, 4)} <= set(scalars)
    epochs = [epoch_end_step(16 * epoch) for epoch in (1, 2, 3)]  # 3 epochs of 16 steps
    assert [step for step, _ in scalars["grad_flow/global/grad_norm"]] == epochs
    assert read_image_tags(run) == ["grad_flow/chart"]


def test_plain_loop_measures_without_lightning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _run("plain_loop.py", tmp_path, monkeypatch)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["epoch 0", "epoch 1", "epoch 2"]
    for line in lines:
        ratio = float(line.split("update ratio ")[1].split(";")[0])
        assert 0 < ratio < 1
    assert not (tmp_path / "runs").exists()


def test_long_epoch_writes_at_each_logging_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _run("long_epoch.py", tmp_path, monkeypatch)
    assert capsys.readouterr().out.strip().endswith("tensorboard --logdir runs")
    scalars = read_scalars(tmp_path / "runs" / "long_epoch")
    assert [s for s, _ in scalars["loss"]] == [49, 99, 149, 199, 249, 299]
    for tag in ("grad_flow/grad_norm_step/net.0", "activations/mean_step/net.2"):
        assert [s for s, _ in scalars[tag]] == [0, 49, 99, 149, 199, 249, 299]
    assert [s for s, _ in scalars["dead_relu/dead_fraction/net.1"]] == [epoch_end_step(300)]
    assert read_image_tags(tmp_path / "runs" / "long_epoch") == [
        "activations/heatmap/mean",
        "activations/heatmap/std",
        "activations/heatmap/zero_fraction",
        "grad_flow/chart",
    ]


def test_wandb_offline_example_writes_the_pictures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("wandb")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    _run("wandb_offline.py", tmp_path, monkeypatch)
    assert "wandb sync" in capsys.readouterr().out
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    media = run / "files" / "media"
    assert len(list((media / "images" / "grad_flow").glob("chart_*.png"))) == 3
    assert len(list((media / "images" / "grad_flow").glob("heatmap_*.png"))) == 3
    # the epochs' summaries (a logging step's text is under alarms_step)
    assert len(list((media / "table" / "grad_flow").glob("alarms_[0-9]*.table.json"))) == 3


def test_mlflow_example_logs_figures_and_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    mlflow = pytest.importorskip("mlflow")
    _run("mlflow_local.py", tmp_path, monkeypatch)
    run_id = capsys.readouterr().out.split("MLflow run ")[1].split(";")[0]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    charts = [a.path for a in client.list_artifacts(run_id, "grad_flow/chart")]
    epochs = [epoch_end_step(16 * epoch) for epoch in (1, 2, 3)]  # 3 epochs of 16 steps
    assert charts == [f"grad_flow/chart/step_{s:06d}.png" for s in epochs]
    history = client.get_metric_history(run_id, "grad_flow/global/grad_norm")
    assert [m.step for m in history] == epochs
