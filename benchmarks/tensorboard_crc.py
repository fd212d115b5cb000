"""What TensorBoard's event-file checksums cost: its pure-Python CRC-32C against the C one
the TensorBoard sink gives its logger's writer (``lightning_hooks/internals/tensorboard.py``).

Each fit computes every record's checksums with the one measured, through TensorBoard's own
``masked_crc32c`` (the sink's own install is held off, so both are timed the same way).

For each configuration, one 200-step fit of the launch-bound stand-in (``overhead._launch``,
one torch thread) per checksum: the bytes and records written, the CPU time of the checksums
(``thread_time`` in TensorBoard's writer thread, where they run holding the GIL), and the wall
time of our saves (each logging step's flush waits for the writer thread)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/tensorboard_crc.py
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as pure
from tensorboard.summary.writer import record_writer

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]

import google_crc32c  # noqa: E402
import overhead  # noqa: E402

import lightning_hooks.callbacks.lifecycle as writing  # noqa: E402
import lightning_hooks.logging.tensorboard as sink  # noqa: E402
from lightning_hooks.internals import tensorboard as _crc  # noqa: E402


def measure(
    crc: Callable[[Any], int], make: Callable[[], list[Any]], steps: int
) -> dict[str, float]:
    """One fit with ``crc`` as TensorBoard's record checksum."""
    spent = {"cpu": 0.0, "bytes": 0.0, "records": 0.0}
    saves: list[float] = []

    def timed(data: Any) -> int:
        started = time.thread_time()
        try:
            return crc(data)
        finally:
            spent["cpu"] += time.thread_time() - started
            spent["bytes"] += len(data)
            spent["records"] += 0.5  # two checksums a record: its header's and its data's

    save = writing.save_loggers

    def timed_save(loggers: Any, **kwargs: Any) -> None:
        started = time.perf_counter()
        save(loggers, **kwargs)
        saves.append(time.perf_counter() - started)

    record_writer.masked_crc32c = timed
    writing.save_loggers = timed_save
    install = sink.fast_checksums
    sink.fast_checksums = lambda experiment: False  # every record through ``timed``
    try:
        overhead.fit("launch", make(), steps)
    finally:
        writing.save_loggers = save
        record_writer.masked_crc32c = pure
        sink.fast_checksums = install
    return {
        **spent,
        "save_median_ms": statistics.median(saves) * 1e3,
        "save_max_ms": max(saves) * 1e3,
    }


def main() -> None:
    torch.set_num_threads(1)
    assert google_crc32c.implementation == "c", "google_crc32c with its C implementation is needed"
    fast = _crc.Checksums(value=google_crc32c.value, fallback=pure).masked_crc32c
    found = overhead.discovered()
    configs = {
        "GradFlowCallback()": lambda: [found["GradFlowCallback"]()],
        "all five at their defaults": lambda: [cls() for cls in found.values()],
    }
    crcs = {"TensorBoard's (pure Python)": pure, "C (google_crc32c)": fast}
    print(
        "| configuration | checksum | bytes | records | checksum CPU | save: median | save: max |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, make in configs.items():
        for label, crc in crcs.items():
            r = measure(crc, make, 200)
            print(
                f"| {name} | {label} | {r['bytes']:.0f} | {r['records']:.0f} "
                f"| {r['cpu'] * 1e3:.1f} ms | {r['save_median_ms']:.2f} ms "
                f"| {r['save_max_ms']:.2f} ms |"
            )
    record_writer.masked_crc32c = fast


if __name__ == "__main__":
    main()
