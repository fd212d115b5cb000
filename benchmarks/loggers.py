"""What each logger shows: one ``Trainer.fit`` per logger (and TensorBoard + W&B together), each
logger's own storage read back: per-layer scalars, pictures, histograms, alarm text.

The fit: ``TinyMLP`` of the test suite, 2 epochs of 4 steps, ``GradFlowCallback(histograms=True,
heatmap=True)``, ``ActivationStatsCallback(histograms=True)`` and ``FeatureMapCallback()``.
W&B runs offline, MLflow on a local sqlite store; nothing reaches the network.

Usage::

    PYTHONPATH=$PWD:$PWD/tests python benchmarks/loggers.py [--save]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from pytorch_lightning.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger, WandbLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_hooks import ActivationStatsCallback, FeatureMapCallback, GradFlowCallback

from conftest import TinyMLP, make_trainer, read_histograms, read_image_tags, read_scalars

RESULTS = Path(__file__).parent / "results"
SETUPS = ("tensorboard", "csv", "mlflow", "wandb", "tensorboard+wandb")


def _per_layer(keys: Any) -> int:
    return len([key for key in keys if str(key).count("/") >= 2])


def _tensorboard(root: Path, _: Any) -> dict[str, Any]:
    run = root / "tb"
    (events,) = run.rglob("events.out.tfevents.*")
    acc = EventAccumulator(str(events.parent), size_guidance={"images": 0})
    acc.Reload()
    images = sum(len(acc.Images(tag)) for tag in read_image_tags(run))
    return {
        "per-layer scalars": _per_layer(read_scalars(run)),
        "pictures": f"{images} images",
        "histograms": len(read_histograms(run)),
        "alarm text": "text summary",
    }


def _wandb(root: Path, logger: Any) -> dict[str, Any]:
    import wandb

    summary = logger.experiment.summary
    values = {key: summary[key] for key in list(summary.keys())}
    media = Path(logger.experiment.dir) / "media"
    wandb.finish()
    numbers = [k for k, v in values.items() if isinstance(v, int | float)]
    histograms = [
        k for k, v in values.items() if hasattr(v, "get") and v.get("_type") == "histogram"
    ]
    return {
        "per-layer scalars": _per_layer(numbers),
        "pictures": f"{len(list((media / 'images').rglob('*.png')))} image files",
        "histograms": len(histograms),
        "alarm text": f"{len(list((media / 'table').rglob('*.json')))} tables",
    }


def _mlflow(root: Path, logger: Any) -> dict[str, Any]:
    client = logger.experiment

    def walk(path: str | None = None) -> Iterator[str]:
        for item in client.list_artifacts(logger.run_id, path):
            yield from walk(item.path) if item.is_dir else [item.path]

    artifacts = list(walk())
    images = [a for a in artifacts if a.startswith("images/") and a.endswith(".png")]
    figures = [a for a in artifacts if a.endswith(".png") and a not in images]
    return {
        "per-layer scalars": _per_layer(client.get_run(logger.run_id).data.metrics),
        "pictures": f"{len(figures)} figures + {len(images)} images",
        "histograms": "no (none in MLflow)",
        "alarm text": f"{len([a for a in artifacts if a.endswith('.md')])} Markdown artifacts",
    }


def _csv(root: Path, logger: Any) -> dict[str, Any]:
    log_dir = Path(logger.log_dir)
    with (log_dir / "metrics.csv").open() as file:
        header = next(csv.reader(file))
    return {
        "per-layer scalars": _per_layer(header),
        "pictures": f"{len(list(log_dir.rglob('*.png')))} PNG files",
        "histograms": "no",
        "alarm text": ", ".join(p.name for p in log_dir.glob("*.md")),
    }


def _loggers(setup: str, root: Path) -> dict[str, Any]:
    loggers: dict[str, Any] = {}
    if "tensorboard" in setup:
        loggers["tensorboard"] = TensorBoardLogger(str(root), name="tb", version=0)
    if "wandb" in setup:
        loggers["wandb"] = WandbLogger(save_dir=str(root), project="lightning_hooks", offline=True)
    if setup == "mlflow":
        uri = f"sqlite:///{root}/mlflow.db"
        loggers["mlflow"] = MLFlowLogger("lightning_hooks", tracking_uri=uri)
    if setup == "csv":
        loggers["csv"] = CSVLogger(str(root), name="csv", version=0)
    return loggers


READERS = {"tensorboard": _tensorboard, "wandb": _wandb, "mlflow": _mlflow, "csv": _csv}


def measure(setup: str, root: Path) -> list[dict[str, Any]]:
    """One fit with ``setup``'s loggers; a row per logger, read from its own storage."""
    torch.manual_seed(0)
    loggers = _loggers(setup, root)
    callbacks = [
        GradFlowCallback(histograms=True, heatmap=True),
        ActivationStatsCallback(histograms=True),
        FeatureMapCallback(),
    ]
    make_trainer(root, logger=list(loggers.values()), max_epochs=2, callbacks=callbacks).fit(
        TinyMLP()
    )
    return [
        {"setup": setup, "logger": kind, "run completes": "yes", **READERS[kind](root, logger)}
        for kind, logger in loggers.items()
    ]


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/loggers.*")
    args = parser.parse_args()
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for setup in SETUPS:
            rows += measure(setup, Path(tmp) / setup.replace("+", "_"))
    text = table(rows)
    print(text)
    if args.save:
        (RESULTS / "loggers.md").write_text(f"{__doc__.split(chr(10) * 2)[0]}\n\n{text}\n")
        (RESULTS / "loggers.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
