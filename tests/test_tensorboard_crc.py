"""TensorBoard's event-file checksums in C (``lightning_hooks/logging/tensorboard.py``): the
same values as TensorBoard's pure-Python ones, and event files its reader (which checks every
checksum) reads back after a real ``Trainer.fit``."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as pure
from tensorboard.summary.writer import record_writer

from lightning_hooks import GradFlowCallback
from lightning_hooks.internals import tensorboard as _crc

from conftest import read_scalars


def test_the_checksums_are_tensorboards() -> None:
    assert _crc.fast_checksums()
    installed = record_writer.masked_crc32c
    assert isinstance(getattr(installed, "__self__", None), _crc.Checksums)
    rng = random.Random(0)
    sizes = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, 4096, 70_001]
    for size in sizes:
        data = rng.randbytes(size)
        assert installed(data) == pure(data), size
        assert installed(bytearray(data)) == pure(data), size


def test_an_error_in_the_c_function_falls_back_to_tensorboards() -> None:
    def broken(data: bytes) -> int:
        raise RuntimeError("no C")

    checksums = _crc.Checksums(value=broken, fallback=pure)
    assert checksums.masked_crc32c(b"event") == pure(b"event")


def test_a_fit_writes_event_files_through_it_that_tensorboard_reads_back(
    trainer_factory: Any, tmp_path: Path
) -> None:
    from conftest import TinyMLP

    trainer_factory(callbacks=[GradFlowCallback()], max_epochs=2).fit(TinyMLP())
    assert isinstance(getattr(record_writer.masked_crc32c, "__self__", None), _crc.Checksums)
    scalars = read_scalars(tmp_path)  # every record's two checksums checked by the reader
    assert len(scalars["grad_flow/grad_norm/net.0"]) == 2
