"""How scalars reach the loggers: one TensorBoard event per logging call for a plain
``TensorBoardLogger``, the logger's own ``log_metrics`` for any other (a subclass, a prefix, CSV),
the same tags, steps and values either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from lightning_hooks import (
    ActivationStatsCallback,
    DeadReLUCallback,
    GradFlowCallback,
    LayerTimeCallback,
    LightningHooksWarning,
    internals,
)
from lightning_hooks import logging as hooks_logging
from lightning_hooks.logging import LoggerSink, log_scalars, register_sink, sinks_for
from lightning_hooks.logging.tensorboard import TensorBoardSink

from conftest import TinyMLP, make_trainer, read_scalars

METRICS = {"grad_flow/a": 1.5, "grad_flow/b": -2.0, "grad_flow/c": float("nan")}


def _events(root: Path) -> list[Any]:
    files = sorted(root.rglob("events.out.tfevents.*"))
    assert len(files) == 1, files
    return [e for e in EventFileLoader(str(files[0])).Load() if e.HasField("summary")]


class _Counting(TensorBoardLogger):
    """A subclass: its own ``log_metrics`` must be called (it may log otherwise)."""

    calls = 0

    def log_metrics(self, metrics: Any, step: int | None = None) -> None:
        type(self).calls += 1
        super().log_metrics(metrics, step)


@pytest.mark.skipif(not internals.speedups(), reason="the speed-up it tests is off")
def test_a_tensorboard_logger_gets_one_event_holding_every_value(tmp_path: Path) -> None:
    logger = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    log_scalars([logger], METRICS, step=7)
    logger.finalize("success")
    (event,) = _events(tmp_path)
    assert event.step == 7
    # the loader hands simple values over as scalar tensors (TensorBoard's data_compat)
    got = {v.tag: v.tensor.float_val[0] for v in event.summary.value}
    assert list(got) == list(METRICS)
    assert got["grad_flow/a"] == 1.5 and got["grad_flow/b"] == -2.0
    assert got["grad_flow/c"] != got["grad_flow/c"]  # NaN kept, as add_scalar keeps it


@pytest.mark.parametrize(
    "make",
    [
        lambda root: _Counting(str(root), name="tb", version=0),
        lambda root: TensorBoardLogger(str(root), name="tb", version=0, prefix="run"),
    ],
    ids=["subclass", "prefix"],
)
def test_other_tensorboard_loggers_log_through_their_own_log_metrics(
    make: Any, tmp_path: Path
) -> None:
    _Counting.calls = 0
    logger = make(tmp_path)
    log_scalars([logger], METRICS, step=3)
    logger.finalize("success")
    events = _events(tmp_path)
    assert len(events) == len(METRICS)  # one event per scalar: Lightning's add_scalar
    prefix = "run-" if logger._prefix else ""
    assert {v.tag for e in events for v in e.summary.value} == {prefix + t for t in METRICS}
    assert _Counting.calls == (1 if isinstance(logger, _Counting) else 0)


def test_a_fit_logs_the_same_values_to_tensorboard_and_csv(tmp_path: Path) -> None:
    """Through ``Trainer.fit``: TensorBoard's batched events and the CSV logger's rows agree."""
    tb = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    csv = CSVLogger(str(tmp_path), name="csv", version=0)
    trainer = make_trainer(tmp_path, logger=[tb, csv], callbacks=[GradFlowCallback()])
    trainer.fit(TinyMLP())
    scalars = read_scalars(tmp_path / "tb")
    rows = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    tag = "grad_flow/grad_norm_step/net.0"
    column = header.index(tag)
    csv_values = [
        (int(r.split(",")[header.index("step")]), float(r.split(",")[column]))
        for r in rows[1:]
        if r.split(",")[column]
    ]
    assert csv_values == [(s, pytest.approx(v, rel=1e-6)) for s, v in scalars[tag]]
    assert len(csv_values) == trainer.global_step  # log_every_n_steps=1: every step
    assert isinstance(trainer.loggers[0], pl.loggers.TensorBoardLogger)


class _SavesPerBatch(pl.Callback):
    """Placed after ours: how many logger saves each batch's hooks made (ours run first)."""

    def __init__(self) -> None:
        self.saves = 0
        self.per_batch: list[tuple[int, int]] = []  # (batch_idx, saves since the last batch)

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.per_batch.append((args[-1], self.saves))
        self.saves = 0


@pytest.mark.parametrize("last_fails", [False, True], ids=["all-live", "last-fails"])
def test_one_logger_save_per_batch_whatever_the_number_of_callbacks_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, last_fails: bool
) -> None:
    """Three callbacks write at every step: one save (flush) per batch, not one per callback;
    when the last of them fails, the one before it saves for the rest, and nothing is lost."""
    counter = _SavesPerBatch()
    save = TensorBoardLogger.save

    def counting_save(self: TensorBoardLogger) -> None:
        counter.saves += 1
        save(self)

    monkeypatch.setattr(TensorBoardLogger, "save", counting_save)
    ours = [
        GradFlowCallback(every_n_steps=1),
        ActivationStatsCallback(every_n_steps=1),
        DeadReLUCallback(every_n_steps=1),
    ]
    if last_fails:

        def broken(wait: bool) -> None:
            raise RuntimeError("broken writer")

        monkeypatch.setattr(ours[-1].tracker, "take_copy", broken)
        ours[-1].strict = False  # the suite sets LIGHTNING_HOOKS_STRICT=1
    trainer = make_trainer(
        tmp_path, max_epochs=2, log_every_n_steps=1000, callbacks=[*ours, counter]
    )
    if last_fails:
        with pytest.warns(LightningHooksWarning, match="DeadReLUCallback is disabled"):
            trainer.fit(TinyMLP())
    else:
        trainer.fit(TinyMLP())
    # The first batch of an epoch also counts the saves of the previous epoch's end. What the
    # callbacks wrote at a batch's end, the failed one's neighbours included, is saved once, by
    # the first of them at the next batch's start.
    within = [saves for batch_idx, saves in counter.per_batch if batch_idx > 0]
    assert within == [1] * 6
    scalars = read_scalars(tmp_path)
    for tag in ("grad_flow/grad_norm_step/net.0", "activations/mean_step/net.0"):
        assert [step for step, _ in scalars[tag]] == list(range(8)), tag


def test_a_sink_registered_before_any_write_keeps_the_built_in_ones(tmp_path: Path) -> None:
    class Nothing(LoggerSink):
        @classmethod
        def accepts(cls, logger: Any) -> bool:
            return False

    register_sink(Nothing)
    try:
        tb = TensorBoardLogger(tmp_path)
        sinks = sinks_for([tb, CSVLogger(tmp_path), tb])  # a logger listed twice: one sink
        assert [type(s).__name__ for s in sinks] == ["TensorBoardSink", "CSVSink"]
    finally:
        hooks_logging._KINDS.remove(Nothing)


def test_a_logging_step_writes_each_scalar_through_each_sink_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[tuple[str, str, int]] = []
    for kind in (LoggerSink, TensorBoardSink):
        original = kind.scalars

        def counting(self: Any, metrics: Any, step: int, original: Any = original) -> None:
            written.extend((type(self).__name__, tag, step) for tag in metrics)
            original(self, metrics, step)

        monkeypatch.setattr(kind, "scalars", counting)
    csv = CSVLogger(str(tmp_path), name="csv", version=0)
    tb = TensorBoardLogger(str(tmp_path), name="tb", version=0)
    ours = [GradFlowCallback(), ActivationStatsCallback(), DeadReLUCallback(), LayerTimeCallback()]
    make_trainer(tmp_path, logger=[tb, csv], callbacks=ours, max_epochs=2).fit(TinyMLP())
    assert {sink for sink, _, _ in written} == {"TensorBoardSink", "CSVSink"}
    assert len(written) == len(set(written))
    for tag, events in read_scalars(tmp_path / "tb").items():
        assert len({step for step, _ in events}) == len(events), tag
