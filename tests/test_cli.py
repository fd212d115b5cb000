"""``lightning-hooks report`` on the event files of real ``Trainer.fit`` runs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hooks import (
    DeadReLUCallback,
    GradFlowCallback,
    LightningHooksWarning,
    TrainingAlarmWarning,
)
from lightning_hooks.cli import main
from lightning_hooks.core.alarms import ALARM_RULES
from lightning_hooks.tags import NOTICES, NOTICES_0_2_0

from conftest import TinyMLP, default_callback_types, epoch_end_step, make_trainer, read_scalars

ROOT = Path(__file__).resolve().parents[1]


class NaNAtStep(TinyMLP):
    """TinyMLP whose loss is NaN at one batch: every gradient of that step is non-finite."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * math.nan if batch_idx == 1 else loss


class DeadFractionLogger(pl.Callback):
    """Logs, per ReLU, the fraction of zero outputs in the last training batch, plain torch,
    under the documented tag scheme ``dead_relu/dead_fraction/{layer}``, and an alarm count, as
    the epoch's metrics (at Lightning's epoch step, as the library's epoch values)."""

    def __init__(self) -> None:
        self.fraction: dict[str, float] = {}

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: Any, batch: Any, *_: Any
    ) -> None:
        x = batch[0]
        for name, module in pl_module.net.named_children():
            x = module(x)
            if isinstance(module, nn.ReLU):
                self.fraction[f"net.{name}"] = float((x == 0).float().mean())

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        metrics = {f"dead_relu/dead_fraction/{k}": v for k, v in self.fraction.items()}
        metrics["dead_relu/alarms/dead_layer"] = float(
            sum(v >= 0.5 for v in self.fraction.values())
        )
        pl_module.log_dict(metrics)


def _report_json(logdir: Path, *extra: str, capsys: pytest.CaptureFixture[str]) -> Any:
    code = main(["report", str(logdir), "--format", "json", *extra])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def test_json_report_holds_the_last_epoch_worst_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_trainer(tmp_path, max_epochs=2, callbacks=[GradFlowCallback()]).fit(TinyMLP())
    code, payload, _ = _report_json(tmp_path, capsys=capsys)
    assert code == 0
    (run,) = payload["runs"]
    scalars = read_scalars(tmp_path)
    last_step = scalars["grad_flow/global/grad_norm"][-1][0]
    assert run["run"] == "tb/version_0" and run["step"] == last_step
    for row in run["layers"]:
        for stat in ("grad_norm", "update_ratio", "grad_abs_max"):
            step, value = scalars[f"grad_flow/{stat}/{row['layer']}"][-1]
            assert step == last_step
            assert row[f"grad_flow/{stat}"] == pytest.approx(value, rel=1e-6)
    # No non-finite gradient, no dead ReLU: worst first is the update ratio furthest from 1e-3.
    off = {
        t.rsplit("/", 1)[1]: abs(math.log10(v[-1][1] / 1e-3))
        for t, v in scalars.items()
        if t.startswith("grad_flow/update_ratio/")
    }
    assert [row["layer"] for row in run["layers"]] == sorted(off, key=off.__getitem__, reverse=True)


def test_fail_on_nonfinite_gradients_fails_the_broken_run_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_trainer(tmp_path / "ok", callbacks=[GradFlowCallback()]).fit(TinyMLP())
    # GradFlowCallback's default alarms warn as it happens: the NaN gradient and loss at step 1,
    # then the weights it poisoned from step 2 on (once per cause per epoch, not once per step).
    with pytest.warns(TrainingAlarmWarning) as record:
        make_trainer(tmp_path / "nan", callbacks=[GradFlowCallback()]).fit(NaNAtStep())
    alarms = [str(w.message) for w in record if issubclass(w.category, TrainingAlarmWarning)]
    assert [m.split(": ")[:2] for m in alarms] == [
        ["GradFlowCallback [nonfinite]", "non-finite gradient at optimizer step 1"],
        ["GradFlowCallback [diverging]", "loss diverging at optimizer step 1"],
        ["GradFlowCallback [nonfinite]", "non-finite weights at optimizer step 2"],
    ]
    assert main(["report", str(tmp_path / "ok"), "--fail-on", "grad_nonfinite>0"]) == 0
    capsys.readouterr()
    code, payload, err = _report_json(tmp_path, "--fail-on", "grad_nonfinite>0", capsys=capsys)
    assert code == 1
    nan_run = next(r for r in payload["runs"] if r["run"].startswith("nan"))
    counts = {r["layer"]: r["grad_flow/grad_nonfinite"] for r in nan_run["layers"]}
    # The NaN step (batch 1) poisons the weights: steps 1, 2 and 3 of 4 have NaN gradients in
    # every layer (behind a ReLU, entries it masks get a finite 0, the others NaN).
    assert counts == dict.fromkeys(counts, 3.0)
    assert len(payload["violations"]) == 3 and all(
        v.startswith("nan") for v in payload["violations"]
    )
    assert err.count("FAIL nan/tb/version_0: net.") == 3


def test_dead_fraction_and_alarm_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dead = DeadFractionLogger()
    pl.seed_everything(0, verbose=False)
    make_trainer(tmp_path, callbacks=[GradFlowCallback(), dead]).fit(TinyMLP())
    code, payload, _ = _report_json(tmp_path, "--fail-on", "dead_fraction>=0.0", capsys=capsys)
    (run,) = payload["runs"]
    got = {
        r["layer"]: r["dead_relu/dead_fraction"]
        for r in run["layers"]
        if "dead_relu/dead_fraction" in r
    }
    assert got == pytest.approx(dead.fraction)
    worst = max(dead.fraction, key=dead.fraction.__getitem__)
    assert run["layers"][0]["layer"] == worst, "dead fraction ranks right after non-finite"
    assert code == 1 and len(payload["violations"]) == 2
    alarms = sum(v >= 0.5 for v in dead.fraction.values())
    # Counts are per rule, per run, never layer rows: the logger's rule and every rule of
    # GradFlowCallback's default alarms (a healthy run: all zero), read back from the event
    # files: the rules that warn under alarms/, those only logged (the notices) under notices/.
    scalars = read_scalars(tmp_path)
    grad_counts = {
        t: v[-1][1]
        for t, v in scalars.items()
        if t.startswith(("grad_flow/alarms/", "grad_flow/notices/"))
        and not t.endswith("/spike_score")
    }
    noticed = {f"grad_flow/notices/{rule}" for rule in NOTICES}
    warned = {f"grad_flow/alarms/{rule}" for rule in ALARM_RULES if rule not in NOTICES}
    assert set(grad_counts) == warned | noticed
    assert run["warnings"] == {
        "dead_relu/alarms/dead_layer": alarms,
        **{t: grad_counts[t] for t in warned},
    }
    assert run["notices"] == {t: grad_counts[t] for t in noticed}
    assert not set(ALARM_RULES) & {r["layer"] for r in run["layers"]}
    assert {r["layer"] for r in run["layers"]} == {"net.0", "net.1", "net.2", "net.3", "net.4"}
    assert main(["report", str(tmp_path), "--fail-on", "warnings>0"]) == int(alarms > 0)
    assert main(["report", str(tmp_path), "--fail-on", "dead_fraction>1"]) == 0


class EpochAlarm(pl.Callback):
    """Logs ``watchdog/alarms/late`` = 2 in the first epoch and 0 afterwards, as an epoch metric."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        pl_module.log("watchdog/alarms/late", 2.0 if trainer.current_epoch == 0 else 0.0)


def test_alarm_counts_are_summed_over_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    callbacks = [GradFlowCallback(), EpochAlarm()]
    make_trainer(tmp_path, max_epochs=3, callbacks=callbacks).fit(TinyMLP())
    scalars = read_scalars(tmp_path)
    assert [v for _, v in scalars["watchdog/alarms/late"]] == [2.0, 0.0, 0.0]
    code, payload, _ = _report_json(tmp_path, "--fail-on", "warnings>=2", capsys=capsys)
    (run,) = payload["runs"]
    expected = {
        t: math.fsum(v for _, v in events)
        for t, events in scalars.items()
        if t.split("/")[1:2] == ["alarms"] and not t.endswith("/spike_score")
    }
    assert run["warnings"] == expected and expected["watchdog/alarms/late"] == 2
    assert code == 1, "an alarm of the first epoch is not hidden by the quiet ones after it"
    assert main(["report", str(tmp_path), "--fail-on", "watchdog/alarms/late<2"]) == 0
    assert main(["report", str(tmp_path), "--fail-on", "watchdog/alarms/late>=2"]) == 1
    assert main(["report", str(tmp_path), "--fail-on", "grad_flow/alarms/explosion>0"]) == 0
    assert main(["report", str(tmp_path), "--fail-on", "grad_flow/notices/spike>0"]) == 0
    capsys.readouterr()
    # spike is a notice at the default on_alarm: a rule on its warnings says where it is
    assert main(["report", str(tmp_path), "--fail-on", "grad_flow/alarms/spike>0"]) == 2
    assert "spike was a notice, logged and never warned, as grad_flow/notices/spike" in (
        capsys.readouterr().err
    )
    assert "warnings: watchdog/alarms/late=2" in _table(tmp_path, capsys)


def _table(logdir: Path, capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(["report", str(logdir)]) == 0
    return capsys.readouterr().out


def test_table_through_the_installed_module(tmp_path: Path) -> None:
    make_trainer(tmp_path, callbacks=[GradFlowCallback()]).fit(TinyMLP())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "lightning_hooks.cli", "report", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    step = epoch_end_step(4)  # one epoch of 4 steps
    assert lines[0].startswith(f"run tb/version_0  (step {step}, 3 layers, worst first)")
    assert lines[1].split() == ["layer", "grad_norm", "update_ratio", "grad_nonfinite"]
    assert sorted(line.split()[0] for line in lines[2:5]) == ["net.0", "net.2", "net.4"]
    assert lines[-2:] == ["warnings: none", "notices: none"]


def test_no_events_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert f"no lightning_hooks events under {tmp_path}" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'}: no such directory" in capsys.readouterr().err


@pytest.mark.parametrize(
    "rule",
    [
        "dead fraction high",
        "warnings>nan",  # a comparison with NaN never holds: the gate would always pass
        "grad_norm>1e",
        "warnings>..",
    ],
)
def test_a_malformed_rule_is_a_usage_error(
    rule: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["report", str(tmp_path), "--fail-on", rule]) == 2
    err = capsys.readouterr().err
    assert f"--fail-on {rule!r}: expected <metric><op><number>" in err


def _fit(root: Path, **kwargs: Any) -> Path:
    make_trainer(root, callbacks=[GradFlowCallback(**kwargs)]).fit(TinyMLP())
    (events,) = root.rglob("events.out.tfevents.*")
    return events


def test_an_unknown_metric_fails_closed_and_lists_the_known_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fit(tmp_path)
    assert main(["report", str(tmp_path), "--fail-on", "dead_fractoin>0.5"]) == 2
    err = capsys.readouterr().err
    assert "unknown metric 'dead_fractoin' (did you mean 'dead_fraction'" in err
    known = err.split("known: ")[1].strip().split(", ")
    assert known[:6] == [
        *("dead_fraction", "grad_norm", "update_ratio", "grad_nonfinite", "warnings", "notices")
    ]
    assert {"grad_flow/grad_abs_max", "grad_flow/alarms/vanishing", "setbacks"} <= set(known)
    assert "grad_flow/notices/amp_overflow" not in known, "a notice no gate may name"
    assert main(["report", str(tmp_path), "--fail-on", "grad_flwo/grad_norm>0"]) == 2
    assert "unknown metric 'grad_flwo/grad_norm' (did you mean 'grad_flow/grad_norm'" in (
        capsys.readouterr().err
    )


def test_a_rule_on_what_a_run_never_logged_fails_closed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fit(tmp_path / "quiet", alarms=False)
    assert main(["report", str(tmp_path), "--fail-on", "dead_fraction>0.5"]) == 2
    err = capsys.readouterr().err
    assert "no run logged dead_relu/dead_fraction (is DeadReLUCallback" in err
    assert main(["report", str(tmp_path), "--fail-on", "warnings>0"]) == 2
    assert "no run logged alarm counts" in capsys.readouterr().err
    assert main(["report", str(tmp_path), "--fail-on", "grad_flow/alarms/explosion>0"]) == 2
    assert main(["report", str(tmp_path), "--fail-on", "grad_norm>1e9"]) == 0


def _scalar_record(path: Path) -> int:
    """The byte offset of the first record in ``path`` that holds a scalar (plain parsing)."""
    from tensorboard.compat.proto.event_pb2 import Event

    data, offset = path.read_bytes(), 0
    while True:
        length = int.from_bytes(data[offset : offset + 8], "little")
        event = Event.FromString(data[offset + 12 : offset + 12 + length])
        if any(v.HasField("simple_value") for v in event.summary.value):
            return offset
        offset += length + 16


def test_a_corrupt_or_truncated_event_file_fails_closed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    events = _fit(tmp_path)
    data = bytearray(events.read_bytes())
    offset = _scalar_record(events)
    data[offset + 12 + int.from_bytes(data[offset : offset + 8], "little") - 1] ^= 0x40
    events.write_bytes(bytes(data))  # the float's top byte: still parses, the checksum catches it
    assert main(["report", str(tmp_path)]) == 2
    assert f"{events}: corrupt record at byte {offset} (checksum mismatch)" in (
        capsys.readouterr().err
    )
    data[offset + 12 + int.from_bytes(data[offset : offset + 8], "little") - 1] ^= 0x40
    events.write_bytes(bytes(data[:-10]))
    assert main(["report", str(tmp_path), "--format", "json"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"{events}: truncated: the record at byte" in err
    events.write_bytes(bytes(data))
    assert main(["report", str(tmp_path)]) == 0


def test_progress_on_stderr_only_when_reading_takes_over_a_second(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from lightning_hooks import cli

    for name in ("a", "b", "c"):
        _fit(tmp_path / name)
    assert main(["report", str(tmp_path)]) == 0
    assert "reading event files" not in capsys.readouterr().err

    read = cli.read_run

    def slow(run: Path, logdir: Path) -> Any:
        time.sleep(0.6)
        return read(run, logdir)

    monkeypatch.setattr(cli, "read_run", slow)
    assert main(["report", str(tmp_path)]) == 0
    assert "reading event files" in capsys.readouterr().err


def test_the_known_metrics_are_what_every_callback_logs(tmp_path: Path) -> None:
    import lightning_hooks
    from lightning_hooks.cli import LAYER_METRICS, RULES

    model = TinyMLP()
    model.net[3] = nn.Tanh()  # SaturationCallback watches bounded activations
    callbacks = [cls() for cls in default_callback_types()]
    with warnings.catch_warnings():  # a dead ReLU on this tiny model is not what is tested here
        warnings.simplefilter("ignore", lightning_hooks.LightningHooksWarning)
        make_trainer(tmp_path, callbacks=callbacks).fit(model)
    every = [t.split("/") for t in read_scalars(tmp_path)]
    tags = [t for t in every if not t[1].endswith("_step")]  # a logging step's: see below
    logged = {(t[0], t[1]) for t in tags if len(t) == 3 and t[1] not in ("global", "alarms")}
    stepped = {
        (t[0], t[1].removesuffix("_step")) for t in every if len(t) == 3 and t[1].endswith("_step")
    }
    counted = {(f, kind) for f in RULES for kind in ("alarms", "notices")}
    assert stepped - counted <= logged  # each one an epoch statistic
    known = {(f, s) for f, stats in LAYER_METRICS.items() for s in stats}
    # No attention in an MLP: test_stability.py and test_attention.py hold the attention
    # statistics to transformers' fits. A regressor's one output has no log-partition:
    # test_stability.py holds logit_logz to a classifier's.
    logged -= {("grad_flow", "notices")}
    unseen = {("stability", s) for s in ("attn_logit_max", "attn_entropy_min", "logit_logz")}
    unseen.add(("stability", "logit_logz_max"))
    assert logged == known - unseen
    counts = {(t[0], t[2]) for t in tags if len(t) == 3 and t[1] in ("alarms", "notices")} - {
        ("grad_flow", "spike_score")
    }
    assert counts == {(f, r) for f, rules in RULES.items() for r in rules}
    assert RULES == {"grad_flow": ALARM_RULES}


def test_a_csv_logger_run_reports_as_its_tensorboard_twin(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tb = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    csv_logger = CSVLogger(str(tmp_path), name="csv", version=0)
    callbacks = [GradFlowCallback(), DeadReLUCallback()]
    make_trainer(tmp_path, logger=[tb, csv_logger], max_epochs=2, callbacks=callbacks).fit(
        TinyMLP()
    )
    code, payload, _ = _report_json(tmp_path, "--fail-on", "warnings>=0", capsys=capsys)
    assert code == 1
    csv_run, tb_run = payload["runs"]
    assert (csv_run["run"], tb_run["run"]) == ("csv/version_0", "tb/version_0")
    assert csv_run["layers"] and csv_run["step"] == tb_run["step"] == epoch_end_step(8)
    # TensorBoard keeps float32, metrics.csv the float64 logged: the same report otherwise.
    assert _approx({**csv_run, "run": ""}) == {**tb_run, "run": ""}


def _approx(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _approx(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_approx(v) for v in value]
    return pytest.approx(value, rel=1e-6) if isinstance(value, float) else value


def test_every_alarm_the_report_prints_is_a_name_its_gate_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The report's warnings line names each count as ``family/alarms/rule``: each name it
    prints, given to ``--fail-on``, is known (exit 0 or 1, never 2) and reads the count
    printed."""
    callbacks = [GradFlowCallback(), EpochAlarm()]
    make_trainer(tmp_path, max_epochs=1, callbacks=callbacks).fit(TinyMLP())
    assert main(["report", str(tmp_path)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("warnings: "))
    printed = dict(item.split("=") for item in line.removeprefix("warnings: ").split(", "))
    assert printed == {"watchdog/alarms/late": "2"}
    for name, value in printed.items():
        assert main(["report", str(tmp_path), "--fail-on", f"{name}>={value}"]) == 1
        assert main(["report", str(tmp_path), "--fail-on", f"{name}>{value}"]) == 0


def test_a_gate_over_runs_of_which_some_logged_its_metric_checks_those(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder where one run had ``DeadReLUCallback`` and one did not: ``dead_fraction`` is
    checked on the first, the second is named as not checked, and the exit is the gate's."""
    make_trainer(tmp_path / "with", callbacks=[DeadReLUCallback()]).fit(TinyMLP())
    _fit(tmp_path / "without")
    assert main(["report", str(tmp_path), "--fail-on", "dead_fraction>1"]) == 0
    err = capsys.readouterr().err
    assert "without/tb/version_0: logged no dead_relu/dead_fraction" in err and "not checked" in err
    assert main(["report", str(tmp_path), "--fail-on", "dead_fraction>=0"]) == 1


def test_runs_behind_symbolic_links_are_read_and_a_run_given_as_dot_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _fit(tmp_path / "store" / "run_a")
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "linked").symlink_to(tmp_path / "store" / "run_a")
    (tmp_path / "logs" / "linked" / "loop").symlink_to(tmp_path / "logs")  # a cycle
    code, payload, _ = _report_json(tmp_path / "logs", capsys=capsys)
    assert code == 0 and [r["run"] for r in payload["runs"]] == ["linked/tb/version_0"]
    monkeypatch.chdir(tmp_path / "store" / "run_a" / "tb" / "version_0")
    assert main(["report", "."]) == 0
    assert capsys.readouterr().out.startswith("run version_0  (step")


class DeepMLP(TinyMLP):
    """TinyMLP with 300 more layers: a report of many rows."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 4), *(nn.Linear(4, 4) for _ in range(300)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).sum(1, keepdim=True)  # type: ignore[no-any-return]


def _installed(*args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """The installed ``lightning-hooks`` command (the venv's console script)."""
    command = Path(sys.executable).with_name("lightning-hooks")
    return subprocess.run(
        [str(command), *args], capture_output=True, text=True, timeout=120, check=False, **kwargs
    )


def test_the_installed_command_says_what_it_reads_and_ends_quietly_into_head(
    tmp_path: Path,
) -> None:
    assert "TensorBoard event files or Lightning's CSV logs" in " ".join(
        _installed("report", "--help").stdout.split()
    )
    # a report longer than a pipe holds (64 KiB): the writer meets the closed pipe
    make_trainer(tmp_path, callbacks=[GradFlowCallback()]).fit(DeepMLP())
    command = Path(sys.executable).with_name("lightning-hooks")
    result = subprocess.run(
        f"'{command}' report '{tmp_path}' --format json | head -n 2",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.stdout.splitlines() == ["{", '  "runs": [']
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr


RECOMMENDED = ("grad_nonfinite>0", "dead_fraction>=0.9", "warnings>0")
"""The gate the README and docs/cli.md recommend."""


def _gate(logdir: Path, *rules: str) -> int:
    return main(["report", str(logdir), *(a for rule in rules for a in ("--fail-on", rule))])


class OneBadBatch(pl.LightningModule):
    """A small ReLU regression on fixed noisy data that learns in a few dozen steps and then sits
    at its noise floor. The loss it returns at batch ``bad`` is ``factor`` times its own, the
    difference a constant: the gradient, and so the run's path, are the true loss's, and the
    event is exactly where the test puts it."""

    def __init__(self, bad: int, factor: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.bad = bad
        self.factor = factor

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        scale = self.factor if batch_idx == self.bad else 1.0
        return loss + (scale - 1.0) * loss.detach()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self) -> DataLoader[Any]:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(120 * 32, 8, generator=gen)
        y = (
            x @ torch.linspace(-1, 1, 8).unsqueeze(1)
            + 3.0
            + 2.5 * torch.randn(len(x), 1, generator=gen)
        )
        return DataLoader(TensorDataset(x, y), batch_size=32)


def test_the_recommended_gate_passes_a_run_with_notices_and_fails_a_broken_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One batch whose loss reads 5x in a healthy run opens a setback: logged as a notice,
    never warned, so the recommended gate passes; a NaN loss is warned, and the gate fails on
    it. The report shows the warnings and the notices on lines of their own."""
    callbacks = [GradFlowCallback(), DeadReLUCallback()]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        make_trainer(tmp_path / "bad_batch", callbacks=callbacks, log_every_n_steps=50).fit(
            OneBadBatch(bad=60, factor=5.0)
        )
    assert not [w for w in record if issubclass(w.category, TrainingAlarmWarning)]
    scalars = read_scalars(tmp_path / "bad_batch")
    assert sum(v for _, v in scalars["grad_flow/notices/setback"]) >= 1
    assert _gate(tmp_path / "bad_batch", *RECOMMENDED) == 0
    table = _table(tmp_path / "bad_batch", capsys).splitlines()
    assert table[-2] == "warnings: none"
    assert table[-1].startswith("notices: setbacks=")
    assert _gate(tmp_path / "bad_batch", "setbacks>0") == 1, "a notice a gate may still name"
    with pytest.warns(TrainingAlarmWarning):
        make_trainer(tmp_path / "nan", callbacks=[GradFlowCallback(), DeadReLUCallback()]).fit(
            NaNAtStep()
        )
    capsys.readouterr()
    assert _gate(tmp_path / "nan", *RECOMMENDED) == 1
    err = capsys.readouterr().err
    assert "FAIL tb/version_0: warnings=" in err and "(warnings>0)" in err


def test_alarms_in_a_rule_reads_as_warnings_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``alarms``, 0.2.0's name, summed the notices too; a rule naming it now counts the
    warnings, and says so."""
    make_trainer(tmp_path, callbacks=[GradFlowCallback()], log_every_n_steps=50).fit(
        OneBadBatch(bad=60, factor=5.0)
    )
    capsys.readouterr()
    assert _gate(tmp_path, "alarms>0") == 0
    assert "'alarms' is now 'warnings'" in capsys.readouterr().err


def test_an_amp_overflow_is_a_notice_no_gate_may_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _fit(tmp_path)
    for rule in ("amp_overflows>0", "grad_flow/notices/amp_overflow>0"):
        assert _gate(tmp_path, rule) == 2
        assert "is a notice no gate may name" in capsys.readouterr().err


class As020Logger(TensorBoardLogger):
    """Writes the counts as 0.2.0 did: every rule under ``grad_flow/alarms/``, the setback as
    ``transient``; no notices."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        old = {
            "notices/setback": "alarms/transient",
            "notices_step/setback": "alarms_step/transient",
        }
        renamed = dict(metrics)
        for new, was in (*old.items(), ("notices_step/", "alarms_step/"), ("notices/", "alarms/")):
            renamed = {tag.replace(new, was): value for tag, value in renamed.items()}
        # a notice 0.2.0 did not have
        kept = {tag: value for tag, value in renamed.items() if not tag.endswith("/no_gradient")}
        super().log_metrics(kept, step)


def test_a_run_written_by_0_2_0_reads_its_logged_rules_as_notices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0.2.0 wrote every count under ``grad_flow/alarms/``: the rules it only logged (spike,
    stall, transient, amp_overflow) read back as today's notices, and the gate passes."""
    logger = As020Logger(str(tmp_path), name="tb", version=0)
    make_trainer(tmp_path, logger=logger, callbacks=[GradFlowCallback()]).fit(
        OneBadBatch(bad=60, factor=5.0)
    )
    scalars = read_scalars(tmp_path)
    assert not [t for t in scalars if "/notices" in t]
    assert sum(v for _, v in scalars["grad_flow/alarms/transient"]) >= 1
    code, payload, _ = _report_json(tmp_path, "--fail-on", "warnings>0", capsys=capsys)
    assert code == 0
    (run,) = payload["runs"]
    assert run["notices"]["grad_flow/notices/setback"] >= 1
    assert "grad_flow/alarms/transient" not in run["warnings"]
    assert set(run["notices"]) == {f"grad_flow/notices/{n}" for n in NOTICES_0_2_0.values()}


def test_a_raised_run_reports_its_last_layers_and_the_alarm_that_ended_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under ``on_alarm="raise"`` the fit ends at the NaN step, its count written there: the
    report shows the last step that logged layers, with its layers, and the alarm after it;
    every rule checks that step, and the gate fails on the warning."""
    from lightning_hooks import TrainingAlarmError

    with pytest.raises(TrainingAlarmError, match=r"\[nonfinite\]"):
        make_trainer(tmp_path, callbacks=[GradFlowCallback(on_alarm="raise")]).fit(NaNAtStep())
    scalars = read_scalars(tmp_path)
    layered = scalars["grad_flow/grad_norm_step/net.0"][-1][0]
    # the NaN step's count: every layer's gradient non-finite
    assert layered == 0 and scalars["grad_flow/alarms_step/nonfinite"][-1] == (1, 3.0)
    code, payload, _ = _report_json(tmp_path, capsys=capsys)
    (run,) = payload["runs"]
    assert code == 0 and run["step"] == layered
    assert {row["layer"] for row in run["layers"]} == {"net.0", "net.2", "net.4"}
    assert run["ended"] == {"step": 1, "by": {"grad_flow/alarms/nonfinite": 3.0}}
    table = _table(tmp_path, capsys).splitlines()
    assert table[0].startswith("run tb/version_0  (step 0, 3 layers, worst first)")
    assert "ended: at step 1, after the layers above, by grad_flow/alarms/nonfinite=3" in table
    assert _gate(tmp_path, "grad_nonfinite>0") == 0, "step 0's gradients were finite"
    assert _gate(tmp_path, "grad_norm>1e9") == 0
    capsys.readouterr()
    assert _gate(tmp_path, *RECOMMENDED[::2]) == 1
    assert "FAIL tb/version_0: warnings=3 (warnings>0)" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before")
def test_a_fit_after_a_raised_one_writes_its_own_counts_from_a_checkpoint(tmp_path: Path) -> None:
    """The callback's first fit ends at the NaN step under ``on_alarm="raise"``, its count
    written there. Its next fit resumes a healthy model from the checkpoint saved before the
    NaN: each logging step writes the alarms counted since the last, never a negative count."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    from lightning_hooks import TrainingAlarmError

    callback = GradFlowCallback(on_alarm="raise")
    saved = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    first = make_trainer(tmp_path / "first", callbacks=[callback, saved], enable_checkpointing=True)
    with pytest.raises(TrainingAlarmError, match=r"\[nonfinite\]"):
        first.fit(NaNAtStep())
    assert read_scalars(tmp_path / "first")["grad_flow/alarms_step/nonfinite"][-1] == (1, 3.0)
    (before_nan,) = (tmp_path / "ckpt").glob("*step=1.ckpt")
    again = make_trainer(tmp_path / "again", callbacks=[callback, saved], enable_checkpointing=True)
    again.fit(TinyMLP(), ckpt_path=before_nan)
    counts = {
        tag: values
        for tag, values in read_scalars(tmp_path / "again").items()
        if tag.startswith("grad_flow/alarms_step/")
    }
    assert counts and all(value == 0 for values in counts.values() for _, value in values)


def test_an_epoch_at_its_last_logging_steps_step_reports_the_epoch_counted_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every step a logging step, an ``absolute`` alarm on every step: each epoch's values and its
    last logging step's are written at one step. The report shows that step with the epoch's
    values, and sums each epoch's count once (its last logging step's is in it)."""
    from lightning_hooks import AlarmRules

    callback = GradFlowCallback(alarms=AlarmRules(max_grad_norm=1e-9), chart=False)
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[callback])
    with pytest.warns(TrainingAlarmWarning):
        trainer.fit(TinyMLP())
    scalars = read_scalars(tmp_path)
    last = epoch_end_step(trainer.global_step)
    assert scalars["grad_flow/grad_norm_step/net.0"][-1][0] == last  # the last logging step
    assert scalars["grad_flow/grad_norm/net.0"][-1][0] == last  # and the epoch's values
    epoch_value = scalars["grad_flow/grad_norm/net.0"][-1][1]
    assert epoch_value != scalars["grad_flow/grad_norm_step/net.0"][-1][1]
    code, payload, _ = _report_json(tmp_path, capsys=capsys)
    (run,) = payload["runs"]
    assert code == 0 and run["step"] == last
    (net0,) = [row for row in run["layers"] if row["layer"] == "net.0"]
    assert net0["grad_flow/grad_norm"] == pytest.approx(epoch_value, rel=1e-6)
    epochs = sum(v for _, v in scalars["grad_flow/alarms/absolute"])
    assert epochs == sum(v for _, v in scalars["grad_flow/alarms_step/absolute"]) > 0
    assert run["warnings"]["grad_flow/alarms/absolute"] == epochs


class FailsInEpochOne(TinyMLP):
    """TinyMLP whose second batch of its second epoch raises: the run dies after that epoch's
    first logging step."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.current_epoch == 1 and batch_idx == 1:
            raise RuntimeError("killed")
        return super().training_step(batch, batch_idx)


def test_a_logging_step_after_the_last_epoch_is_reported_with_its_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that dies in its second epoch: its first logging step, one step after the first
    epoch's values, is the last that logged layers; its count adds to the first epoch's."""
    from lightning_hooks import AlarmRules

    callback = GradFlowCallback(alarms=AlarmRules(max_grad_norm=1e-9), chart=False)
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[callback])
    with pytest.warns(TrainingAlarmWarning), pytest.raises(RuntimeError, match="killed"):
        trainer.fit(FailsInEpochOne())
    scalars = read_scalars(tmp_path)
    ((epoch_step, _),) = scalars["grad_flow/grad_norm/net.0"]
    step, value = scalars["grad_flow/grad_norm_step/net.0"][-1]
    assert step == epoch_step + 1 == trainer.global_step - 1  # the second epoch's first step
    code, payload, _ = _report_json(tmp_path, capsys=capsys)
    (run,) = payload["runs"]
    assert code == 0 and run["step"] == step
    (net0,) = [row for row in run["layers"] if row["layer"] == "net.0"]
    assert net0["grad_flow/grad_norm"] == pytest.approx(value, rel=1e-6)
    ((_, epoch_count),) = scalars["grad_flow/alarms/absolute"]
    after = [v for s, v in scalars["grad_flow/alarms_step/absolute"] if s > epoch_step]
    assert after and run["warnings"]["grad_flow/alarms/absolute"] == epoch_count + sum(after)


class _DeadThenFails(TinyMLP):
    """A ReLU that never fires (its layer's bias far below 0), and a failure at step 6, two
    batches into the second epoch: the run's logging steps go on after its last epoch end."""

    def __init__(self) -> None:
        super().__init__()
        with torch.no_grad():
            self.net[2].bias.fill_(-1e3)  # net.3, the second ReLU, never fires

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == 6:
            raise RuntimeError("killed mid-epoch")
        return super().training_step(batch, batch_idx)


def test_a_run_killed_mid_epoch_is_gated_on_its_last_epochs_dead_fraction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``dead_fraction`` is logged at epoch ends only: reported at the run's last logging step,
    after its last epoch end, the rule still checks the epoch's value, and the gate fails."""
    trainer = make_trainer(tmp_path, max_epochs=2, callbacks=[DeadReLUCallback()])
    dead = pytest.warns(LightningHooksWarning, match="'net.3' has 16 of 16 units dead")
    with dead, pytest.raises(RuntimeError, match="killed mid-epoch"):
        trainer.fit(_DeadThenFails())
    scalars = read_scalars(tmp_path)
    assert scalars["dead_relu/dead_fraction/net.3"] == [(3, 1.0)]
    assert max(s for s, _ in scalars["dead_relu/zero_fraction_step/net.3"]) > 3
    assert main(["report", str(tmp_path), "--fail-on", "dead_fraction>=0.9"]) == 1
    assert "dead_fraction" in capsys.readouterr().out


class _FailsAtStep(TinyMLP):
    """Raises at optimizer step ``step``: a run killed there."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.step:
            raise RuntimeError("killed")
        return super().training_step(batch, batch_idx)


@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before")
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_a_run_resumed_from_an_earlier_checkpoint_into_its_folder_drops_the_branch_it_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first fit warns at every step (``max_grad_norm``) for three epochs. A second fit,
    without that rule, resumes from its step-6 checkpoint into the same folder and dies at step
    7, before its epoch's end: the report keeps what came before step 6 (epoch 0, steps 4 and 5)
    and drops what the first fit logged from step 6 on (epochs 1 and 2), which the second never
    logged again."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    from lightning_hooks import AlarmRules

    saved = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first = GradFlowCallback(alarms=AlarmRules(max_grad_norm=1e-9), chart=False)
    trainer = make_trainer(
        tmp_path, max_epochs=3, callbacks=[first, saved], enable_checkpointing=True
    )
    with pytest.warns(TrainingAlarmWarning):
        trainer.fit(TinyMLP())
    first_run = read_scalars(tmp_path)
    epochs = first_run["grad_flow/alarms/absolute"]
    assert [s for s, _ in epochs] == [3, 7, 11]
    # what the resumed run's history holds: epoch 0, and steps 4 and 5 before its checkpoint
    kept = epochs[0][1] + sum(
        n for s, n in first_run["grad_flow/alarms_step/absolute"] if s in (4, 5)
    )
    (step_6,) = (tmp_path / "ckpt").glob("*step=6.ckpt")
    again = make_trainer(
        tmp_path,
        max_epochs=3,
        callbacks=[GradFlowCallback(chart=False)],
        enable_checkpointing=False,
    )
    with pytest.raises(RuntimeError, match="killed"):
        again.fit(_FailsAtStep(7), ckpt_path=step_6)
    _, payload, _ = _report_json(tmp_path, capsys=capsys)
    (run,) = payload["runs"]
    assert run["step"] == 6
    assert kept == 6
    assert run["warnings"]["grad_flow/alarms/absolute"] == kept


def test_a_cut_off_csv_row_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run killed while its ``metrics.csv`` was written ends in a row cut short: read as step 0
    it would wipe the earlier values of its tags and count the steps again. It is refused."""
    logger = CSVLogger(str(tmp_path), name="csv", version=0)
    make_trainer(tmp_path, logger=logger, callbacks=[GradFlowCallback()]).fit(TinyMLP())
    (path,) = tmp_path.rglob("metrics.csv")
    assert main(["report", str(tmp_path)]) == 0
    capsys.readouterr()
    text = path.read_bytes()
    path.write_bytes(text[: len(text) - 40])  # the last row loses its last cells, step among them
    assert main(["report", str(tmp_path)]) == 2
    assert "is cut off (it has no step)" in capsys.readouterr().err


@pytest.mark.parametrize("top", ["0", "-1", "x"])
def test_top_is_at_least_one_row(
    top: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(tmp_path), "--top", top])
    assert exit_info.value.code == 2
    assert f"expected a whole number of rows, at least 1; got {top!r}" in capsys.readouterr().err
