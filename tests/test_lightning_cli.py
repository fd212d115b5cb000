"""Lightning's real ``LightningCLI`` configures every callback: from YAML and the command line.

Each run is ``fit`` through ``lightning.pytorch.cli.LightningCLI`` (jsonargparse, a dev
dependency) on a tiny model, with the callback at its defaults (a YAML ``class_path``) and with a
non-default argument (``--trainer.callbacks+=...`` then ``--trainer.callbacks.<arg>=...``). The
test asserts what the callback was built with and reads its tags back from the event file.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import DataLoader

import lightning_hooks
from lightning_hooks import AlarmRules

from conftest import TinyMLP, dataset, read_scalars

L = pytest.importorskip("lightning.pytorch")
pytest.importorskip("jsonargparse")
from lightning.pytorch.cli import LightningCLI  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class CliNet(L.LightningModule):  # type: ignore[misc, name-defined]
    """8 -> 16 (ReLU) -> 16 (Tanh) -> 1: a layer for every callback; its width is configurable."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.Tanh()
        )
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(dataset(), batch_size=8)


def _trainer_args(root: Path) -> list[str]:
    """A short CPU fit logging to a TensorBoardLogger under ``root``, every step measured."""
    return [
        "--seed_everything=0",
        "--trainer.accelerator=cpu",
        "--trainer.max_steps=4",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
        f"--trainer.logger.save_dir={root}",
        "--trainer.logger.name=tb",
        "--trainer.logger.version=0",
    ]


def _fit(root: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> LightningCLI:
    monkeypatch.setattr(sys, "argv", ["train.py"])  # the CLI warns when given both
    return LightningCLI(CliNet, args=["fit", *_trainer_args(root), *args])


def _ours(cli: LightningCLI) -> list[Any]:
    return [cb for cb in cli.trainer.callbacks if type(cb).__module__.startswith("lightning_hooks")]


def _write(path: Path, callbacks: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))
    return path


# name, the tag family it logs, a non-default argument on the command line, what it becomes.
CASES = [
    ("GradFlowCallback", "grad_flow/", ("include", "net.2"), ("include", ("net.2",))),
    ("ActivationStatsCallback", "activations/", ("include", "net.1"), ("include", ("net.1",))),
    ("DeadReLUCallback", "dead_relu/", ("warn_at", "0.3"), ("warn_at", 0.3)),
    ("SaturationCallback", "saturation/", ("margin", "0.05"), ("margin", 0.05)),
    ("LayerTimeCallback", "layer_time/", ("include", "net.0"), ("include", ("net.0",))),
    ("FeatureMapCallback", "feature_map/", ("layers", "net.2"), ("layers", ("net.2",))),
]
DEFAULT_ONLY = {"include", "layers"}  # arguments whose layer shows in the tags


@pytest.mark.parametrize(("name", "family", "given", "expected"), CASES, ids=[c[0] for c in CASES])
def test_each_callback_from_yaml_at_its_defaults_and_from_the_command_line(
    name: str,
    family: str,
    given: tuple[str, str],
    expected: tuple[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = _write(tmp_path / "config.yaml", [{"class_path": f"lightning_hooks.{name}"}])
    cli = _fit(tmp_path / "yaml", monkeypatch, "--config", str(config))
    (callback,) = _ours(cli)
    assert type(callback) is getattr(lightning_hooks, name)
    assert cli.trainer.global_step == 4
    at_defaults = {t for t in read_scalars(tmp_path / "yaml") if t.startswith(family)}
    assert at_defaults, f"{name} logged nothing under {family}"

    argument, value = given
    cli = _fit(
        tmp_path / "flags",
        monkeypatch,
        f"--trainer.callbacks+=lightning_hooks.{name}",
        f"--trainer.callbacks.{argument}={value}",
    )
    (callback,) = _ours(cli)
    assert getattr(callback, expected[0]) == expected[1]
    tags = {t for t in read_scalars(tmp_path / "flags") if t.startswith(family)}
    assert tags
    if argument in DEFAULT_ONLY:  # the selection narrowed what is logged, to that layer
        layers = {t.rsplit("/", 1)[1] for t in tags if re.search(r"/net\.\d$", t)}
        assert layers == {value}, tags
        assert len(tags) < len(at_defaults)


def test_alarm_rules_nested_and_as_a_plain_mapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nested = {"class_path": "lightning_hooks.AlarmRules", "init_args": {"spike_factor": 5.0}}
    plain = {"window": 7, "max_grad_norm": 100.0}
    callbacks = [  # one layer each: two instances of a callback must watch different layers
        {
            "class_path": "lightning_hooks.GradFlowCallback",
            "init_args": {"alarms": rules, "include": layer},
        }
        for rules, layer in ((nested, "net.0"), (plain, "net.2"), (False, "head"))
    ]
    cli = _fit(tmp_path, monkeypatch, "--config", str(_write(tmp_path / "c.yaml", callbacks)))
    first, second, third = _ours(cli)
    assert first.alarms == AlarmRules(spike_factor=5.0)
    assert second.alarms == AlarmRules(window=7, max_grad_norm=100.0)
    assert third.alarms is None
    assert any(t.startswith("grad_flow/") for t in read_scalars(tmp_path))


def test_stats_callback_with_a_statistic_from_its_class_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stat = {"class_path": "lightning_hooks.core.SaturationTracker", "init_args": {"margin": 0.05}}
    callbacks = [
        {
            "class_path": "lightning_hooks.StatsCallback",
            "init_args": {"stats": [stat], "every_n_steps": 2},
        }
    ]
    cli = _fit(tmp_path, monkeypatch, "--config", str(_write(tmp_path / "c.yaml", callbacks)))
    (callback,) = _ours(cli)
    assert callback.every_n_steps == 2
    assert [(type(s).__name__, s.margin) for s in callback.stats] == [("SaturationTracker", 0.05)]
    assert "saturation/saturated_fraction/net.3" in read_scalars(tmp_path)


PAGE = ROOT / "docs" / "lightning-cli.md"


def _page_yaml() -> str:
    match = re.search(r"```yaml\n(.*?)```", PAGE.read_text(), re.DOTALL)
    assert match, "docs/lightning-cli.md has no yaml block"
    return match.group(1)


def test_the_docs_snippet_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(_page_yaml())
    flags = re.search(
        r"(--trainer\.callbacks\+=\S+)\s+(--trainer\.callbacks\.\S+)", PAGE.read_text()
    )
    assert flags, "docs/lightning-cli.md's command-line example is missing"
    cli = _fit(tmp_path, monkeypatch, "--config", str(config), *flags.groups())
    names = [type(cb).__name__ for cb in _ours(cli)]
    assert names == ["GradFlowCallback", "DeadReLUCallback", "SaturationCallback"]
    assert _ours(cli)[0].alarms.spike_factor == 5.0
    families = {t.split("/", 1)[0] for t in read_scalars(tmp_path)}
    assert {"grad_flow", "dead_relu", "saturation"} <= families


def test_the_docs_snippet_runs_in_pytorch_lightning_cli_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pytorch_lightning.cli import LightningCLI as PlCLI

    config = tmp_path / "config.yaml"
    config.write_text(_page_yaml())
    args = [
        a.replace("lightning.pytorch.loggers", "pytorch_lightning.loggers")
        for a in _trainer_args(tmp_path)
    ]
    monkeypatch.setattr(sys, "argv", ["train.py"])
    cli = PlCLI(TinyMLP, args=["fit", *args, "--config", str(config)])
    assert [type(cb).__name__ for cb in _ours(cli)] == ["GradFlowCallback", "DeadReLUCallback"]
    families = {t.split("/", 1)[0] for t in read_scalars(tmp_path)}
    assert {"grad_flow", "dead_relu"} <= families


def _typo_section() -> str:
    text = PAGE.read_text()
    return text[text.index("## A typo in a key") :]


def test_the_docs_short_form_of_a_typo_is_what_the_cli_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    block = re.search(r"```text\n(.*?)```", _typo_section(), re.DOTALL)
    assert block, "docs/lightning-cli.md shows no error under its typo section"
    typo = {"class_path": "lightning_hooks.DeadReLUCallback", "init_args": {"warn_att": 0.5}}
    with pytest.raises(SystemExit):
        _fit(tmp_path, monkeypatch, "--config", str(_write(tmp_path / "c.yaml", [typo])))
    printed = capsys.readouterr().err
    lines = [line.strip() for line in block.group(1).splitlines() if line.strip() != "..."]
    assert all(line in printed for line in lines), printed[-1500:]
    positions = [printed.index(line) for line in lines]
    assert positions == sorted(positions), "the page's lines are in the order printed"
    assert len(printed.splitlines()) > 40, "the page says the usage comes first"


def test_the_docs_value_error_is_quoted_by_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quoted = re.search(r"`(AlarmRules\(quiet_read=[^`]+)`", _typo_section())
    assert quoted, "docs/lightning-cli.md quotes no value error"
    rules = {"class_path": "lightning_hooks.AlarmRules", "init_args": {"quiet_read": "groupd"}}
    callback = {"class_path": "lightning_hooks.GradFlowCallback", "init_args": {"alarms": rules}}
    config = _write(tmp_path / "c.yaml", [callback])
    with pytest.raises(ValueError, match=re.escape(quoted.group(1))):
        _fit(tmp_path, monkeypatch, "--config", str(config))
