"""Every logger through one ``Trainer.fit``: TensorBoard, W&B (offline), MLflow (a local sqlite
store) and CSV at once, each read back from its own storage and compared with TensorBoard's
event files. Real clients, nothing on the network."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_hooks import (
    ActivationStatsCallback,
    FeatureMapCallback,
    GradFlowCallback,
    LightningHooksWarning,
)

from conftest import TinyMLP, epoch_end_step, make_trainer, read_histograms, read_scalars

wandb = pytest.importorskip("wandb")
mlflow = pytest.importorskip("mlflow")

PICTURES = ("grad_flow/chart", "grad_flow/heatmap", "activations/heatmap/std", "feature_map/net.0")
HISTOGRAMS = ("grad_flow/grad_log10_abs/net.0", "activations/histogram/net.0")
ALARMS = "grad_flow/alarms"


def _callbacks() -> list[Any]:
    return [
        GradFlowCallback(histograms=True, heatmap=True),
        ActivationStatsCallback(histograms=True),
        FeatureMapCallback(),
    ]


def offline_wandb(monkeypatch: pytest.MonkeyPatch, root: Path) -> WandbLogger:
    """A W&B logger writing under ``root/wandb`` only (offline; config and cache there too)."""
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(root))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    return WandbLogger(save_dir=str(root), project="lightning_hooks", offline=True)


def local_mlflow(root: Path) -> MLFlowLogger:
    """An MLflow logger on a sqlite store under ``root`` (MLflow 3's file store is frozen)."""
    return MLFlowLogger(
        experiment_name="lightning_hooks",
        tracking_uri=f"sqlite:///{root}/mlflow.db",
        artifact_location=str(root / "artifacts"),
    )


class Run:
    """One fit to all four loggers, and what each one's storage holds afterwards."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        torch.manual_seed(0)
        self.root = root
        wb = offline_wandb(monkeypatch, root)
        ml = local_mlflow(root)
        csv_logger = CSVLogger(str(root), name="csv", version=0)
        tb = TensorBoardLogger(str(root), name="tb", version=0)
        make_trainer(
            root, logger=[tb, wb, ml, csv_logger], max_epochs=2, callbacks=_callbacks()
        ).fit(TinyMLP())
        summary = wb.experiment.summary  # readable while the run is open
        self.summary = {key: summary[key] for key in list(summary.keys())}
        self.wandb_dir = Path(wb.experiment.dir)
        wandb.finish()
        self.mlflow = mlflow.MlflowClient(f"sqlite:///{root}/mlflow.db")
        self.run_id = ml.run_id
        self.csv_dir = Path(csv_logger.log_dir)
        self.tb_dir = root / "tb"

    def tb_images(self) -> dict[str, list[int]]:
        acc = _accumulator(self.tb_dir)
        return {tag: [e.step for e in acc.Images(tag)] for tag in acc.Tags()["images"]}

    def tb_text(self, tag: str) -> list[tuple[int, str]]:
        acc = _accumulator(self.tb_dir)
        events = acc.Tensors(f"{tag}/text_summary")
        return [(e.step, e.tensor_proto.string_val[0].decode()) for e in events]

    def mlflow_artifacts(self, path: str | None = None) -> Iterator[str]:
        for item in self.mlflow.list_artifacts(self.run_id, path):
            yield from self.mlflow_artifacts(item.path) if item.is_dir else [item.path]


def _accumulator(logdir: Path) -> EventAccumulator:
    (events,) = logdir.rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events.parent), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    return acc


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield Run(tmp_path_factory.mktemp("loggers"), monkeypatch)


def test_tensorboard_has_every_kind_of_picture(run: Run) -> None:
    images = run.tb_images()
    epochs = [epoch_end_step(4), epoch_end_step(8)]
    assert all(images[tag] == epochs for tag in PICTURES), images
    assert set(HISTOGRAMS) <= set(read_histograms(run.tb_dir))
    assert [step for step, _ in run.tb_text(ALARMS)] == epochs


def test_every_logger_gets_every_scalar_at_the_optimizer_step(run: Run) -> None:
    scalars = read_scalars(run.tb_dir)
    with (run.csv_dir / "metrics.csv").open() as file:
        rows = list(csv.DictReader(file))
    for tag, points in scalars.items():
        _, value = points[-1]
        assert math.isclose(run.summary[tag], value, rel_tol=1e-6), tag
        history = run.mlflow.get_metric_history(run.run_id, tag)
        assert [(m.step, pytest.approx(m.value, rel=1e-6)) for m in history] == points, tag
        csv_points = [(int(r["step"]), float(r[tag])) for r in rows if r.get(tag)]
        assert csv_points == [(s, pytest.approx(v, rel=1e-6)) for s, v in points], tag
    assert run.summary["trainer/global_step"] == epoch_end_step(8)  # the last epoch's values


def test_wandb_gets_each_picture_once_histograms_and_the_alarm_table(run: Run) -> None:
    media = run.wandb_dir / "media"
    for tag, steps in run.tb_images().items():
        files = sorted((media / "images").glob(f"{tag}_*.png"))
        assert len(files) == len(steps), (tag, files)
        assert run.summary[tag]["_type"] == "images/separated"  # log_image takes a list
    for tag in HISTOGRAMS:
        histogram = run.summary[tag]
        assert histogram["_type"] == "histogram" and sum(histogram["values"]) > 0, tag
    # the epochs' summaries: a logging step's text is under alarms_step
    tables = sorted((media / "table").glob(f"{ALARMS}_[0-9]*.table.json"), key=_wandb_order)
    rows = [json.loads(path.read_text())["data"][0] for path in tables]
    assert [(step, text) for step, text in rows] == run.tb_text(ALARMS)


def _wandb_order(path: Path) -> int:
    return int(path.name.split("_")[-2])


def test_mlflow_gets_figures_images_and_alarm_text_per_step(run: Run) -> None:
    artifacts = set(run.mlflow_artifacts())
    images = run.tb_images()
    figures = {tag: steps for tag, steps in images.items() if not tag.startswith("feature_map/")}
    expected = {f"{tag}/step_{s:06d}.png" for tag, steps in figures.items() for s in steps}
    assert expected <= artifacts
    # Feature maps as MLflow images: images/<key>+step+<step>+... ("/" in a key becomes "~").
    keyed = sorted(
        (a.split("+")[0], int(a.split("+")[2]))
        for a in artifacts
        if a.startswith("images/") and a.endswith(".png")
    )
    maps = {tag: steps for tag, steps in images.items() if tag not in figures}
    assert keyed == sorted((f"images/{t.replace('/', '~')}", s) for t in maps for s in maps[t])
    for step, text in run.tb_text(ALARMS):
        path = f"{ALARMS}/step_{step:06d}.md"
        assert mlflow.artifacts.load_text(f"runs:/{run.run_id}/{path}") == text


def test_csv_gets_pngs_per_tag_and_the_alarm_markdown(run: Run) -> None:
    for tag, steps in run.tb_images().items():
        files = sorted(p.name for p in (run.csv_dir / tag).iterdir())
        assert files == [f"step_{s:06d}.png" for s in steps], tag
        assert (run.csv_dir / tag / files[0]).read_bytes().startswith(b"\x89PNG")
    markdown = (run.csv_dir / "grad_flow.alarms.md").read_text()
    for step, text in run.tb_text(ALARMS):
        assert f"## {ALARMS}, step {step}\n\n{text}\n" in markdown


class ClosedWhileTraining(pl.Callback):
    """Deletes the MLflow run while training runs (every write to it raises then) and restores
    it at the end, so that Lightning's own ``finalize`` can close it."""

    def __init__(self, logger: MLFlowLogger) -> None:
        self.logger = logger

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.logger.experiment.delete_run(self.logger.run_id)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.logger.experiment.restore_run(self.logger.run_id)


def test_a_logger_whose_client_raises_is_dropped_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LIGHTNING_HOOKS_STRICT")
    ml = local_mlflow(tmp_path)
    tb = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    callbacks = [ClosedWhileTraining(ml), GradFlowCallback()]
    with pytest.warns(LightningHooksWarning, match="MLFlowLogger raised MlflowException") as record:
        make_trainer(tmp_path, logger=[tb, ml], max_epochs=2, callbacks=callbacks).fit(TinyMLP())
    assert len([w for w in record if w.category is LightningHooksWarning]) == 1
    steps = [step for step, _ in read_scalars(tmp_path / "tb")["grad_flow/grad_norm_step/net.0"]]
    assert steps == list(range(8))  # TensorBoard got every logging step
    assert ml.experiment.get_run(ml.run_id).data.metrics == {}
