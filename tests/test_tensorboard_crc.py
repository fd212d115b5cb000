"""TensorBoard's event-file checksums in C (``lightning_hooks/internals/tensorboard.py``): the
same values and the same records as TensorBoard's pure-Python ones, only in the writers of the
loggers we write to, and event files its reader (which checks every checksum) reads back after a
real ``Trainer.fit``."""

from __future__ import annotations

import functools
import io
import random
from pathlib import Path
from typing import Any

import google_crc32c
import pytorch_lightning as pl
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as pure
from tensorboard.summary.writer import record_writer
from torch.utils.tensorboard import SummaryWriter

from lightning_hooks import GradFlowCallback
from lightning_hooks.internals import tensorboard as _crc

from conftest import TinyMLP, read_scalars

_SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4096, 70_001]


def test_the_checksums_are_tensorboards() -> None:
    checksums = _crc.Checksums(value=google_crc32c.value, fallback=pure)
    rng = random.Random(0)
    for size in _SIZES:
        data = rng.randbytes(size)
        assert checksums.masked_crc32c(data) == pure(data), size
        assert checksums.masked_crc32c(bytearray(data)) == pure(data), size


def test_a_record_is_framed_as_tensorboards() -> None:
    """The same bytes as TensorBoard's ``RecordWriter.write``, record for record."""
    checksums = _crc.Checksums(value=google_crc32c.value, fallback=pure)
    theirs = record_writer.RecordWriter(io.BytesIO())
    ours = record_writer.RecordWriter(io.BytesIO())
    rng = random.Random(1)
    for size in _SIZES:
        data = rng.randbytes(size)
        theirs.write(data)
        _crc._write_record(ours, checksums, data)
    assert ours._writer.getvalue() == theirs._writer.getvalue()


def test_an_error_in_the_c_function_falls_back_to_tensorboards() -> None:
    def broken(data: bytes) -> int:
        raise RuntimeError("no C")

    checksums = _crc.Checksums(value=broken, fallback=pure)
    assert checksums.masked_crc32c(b"event") == pure(b"event")


class _Probe(pl.Callback):
    """Keeps the ``write`` of the logger's record writer, at each epoch's end."""

    def __init__(self, seen: list[object]) -> None:
        self.seen = seen

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        writer = _crc._record_writer(trainer.logger.experiment)  # type: ignore[union-attr]
        self.seen.append(vars(writer).get("write"))


def test_a_fit_writes_event_files_through_it_that_tensorboard_reads_back(
    trainer_factory: Any, tmp_path: Path
) -> None:
    """The logger's writer computes its checksums in C; TensorBoard's module and a writer of the
    user's own keep TensorBoard's."""
    users_own = SummaryWriter(str(tmp_path / "users_own"))
    seen: list[object] = []
    probe = _Probe(seen)
    trainer = trainer_factory(callbacks=[GradFlowCallback(), probe], max_epochs=2)
    trainer.fit(TinyMLP())
    assert seen
    assert all(isinstance(write, functools.partial) for write in seen)
    assert record_writer.masked_crc32c is pure
    assert "write" not in _crc._record_writer(users_own).__dict__
    users_own.add_scalar("users/own", 1.0, 0)
    users_own.close()
    scalars = read_scalars(tmp_path / "tb")  # every record's two checksums checked by the reader
    assert len(scalars["grad_flow/grad_norm/net.0"]) == 2
    assert read_scalars(tmp_path / "users_own")["users/own"] == [(0, 1.0)]
