"""TensorBoard: its sink (scalars as one event per logging step, every picture, the custom
dashboard), and two costs of its writer taken off the training thread's path.

**Checksums.** Without TensorFlow, TensorBoard computes each record's CRC-32C in pure Python, a
byte at a time, holding the GIL (and a logging step's flush waits for it).
:func:`fast_tensorboard_crc` points its record writer at ``google_crc32c``'s C implementation
when installed: the same checksums, the same bytes written.

**Scalars.** Building a ``Summary.Value`` per scalar in protobuf's Python API is slow for the
thousand scalars of a logging step. :func:`scalar_summary` writes the short fixed wire format
itself (each tag's bytes once per run) and lets protobuf parse the ``Summary`` in C: the same
message, tags in order and float32 values (beyond float32's range: infinite in both).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np
from matplotlib.figure import Figure

from lightning_hooks.logging.dashboard import record_tags, write_dashboard
from lightning_hooks.logging.sinks import LoggerSink, Moments, lightning_types

__all__ = [
    "TensorBoardSink",
    "fast_tensorboard_crc",
    "histogram_raw",
    "masked_crc32c",
    "scalar_summary",
]


class TensorBoardSink(LoggerSink):
    """A ``TensorBoardLogger`` (either namespace, or a subclass): its ``SummaryWriter`` gets
    figures, images, histograms, text, embeddings and the custom-scalars layout.

    Example:
        >>> from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
        >>> TensorBoardSink.accepts(TensorBoardLogger("/tmp/x")), TensorBoardSink.accepts(
        ...     CSVLogger("/tmp/x"))
        (True, False)
    """

    shows_pictures: ClassVar[bool] = True

    def __init__(self, logger: Any) -> None:
        super().__init__(logger)
        fast_tensorboard_crc()  # the event files' checksums in C, once

    @classmethod
    def accepts(cls, logger: Any) -> bool:
        return isinstance(logger, lightning_types("TensorBoardLogger"))

    @property
    def _writer(self) -> Any:
        return self.logger.experiment

    def scalars(self, metrics: Mapping[str, float], step: int) -> None:
        """One event holding every value (:meth:`_write_summary`), not one per scalar as the
        logger's ``log_metrics`` writes: the same tags, steps and values, one hand-off to the
        writer thread."""
        if not self._write_summary(metrics, step):
            self.logger.log_metrics(dict(metrics), step=step)
        record_tags(self._writer, metrics)

    def _write_summary(self, metrics: Mapping[str, float], step: int) -> bool:
        """``metrics`` as one event of ``simple_value``s; ``False`` (nothing written) unless the
        logger is a plain ``TensorBoardLogger`` (a subclass may log otherwise) without prefix,
        with a real ``SummaryWriter`` (not rank > 0's dummy)."""
        prefix: str = getattr(self.logger, "_prefix", "")
        if type(self.logger) not in lightning_types("TensorBoardLogger") or prefix:
            return False
        from torch.utils.tensorboard import SummaryWriter

        writer = self._writer
        if not isinstance(writer, SummaryWriter):
            return False
        writer._get_file_writer().add_summary(scalar_summary(metrics), step)  # type: ignore[no-untyped-call]
        return True

    def figure(self, tag: str, figure: Figure, step: int) -> None:
        self._writer.add_figure(tag, figure, global_step=step, close=False)

    def image(self, tag: str, image: Any, step: int) -> None:
        self._writer.add_image(tag, image, global_step=step, dataformats="CHW")

    def histogram(
        self,
        tag: str,
        limits: np.ndarray,
        counts: np.ndarray,
        step: int,
        moments: Moments | None,
    ) -> None:
        raw = histogram_raw(limits, counts, moments)
        self._writer.add_histogram_raw(tag, global_step=step, **raw)

    def text(self, tag: str, text: str, step: int) -> None:
        self._writer.add_text(tag, text, global_step=step)

    def embedding(self, tag: str, features: Any, labels: list[Any] | None, step: int) -> None:
        self._writer.add_embedding(features, metadata=labels, global_step=step, tag=tag)

    def dashboard(self) -> None:
        write_dashboard([self._writer])


def histogram_raw(
    limits: np.ndarray, counts: np.ndarray, moments: Moments | None = None
) -> dict[str, Any]:
    """Keyword arguments of ``SummaryWriter.add_histogram_raw`` for pre-binned counts.

    Args:
        limits: ``[buckets]`` right edges of the buckets.
        counts: ``[buckets]`` counts.
        moments: ``(min, max, sum, sum of squares)`` of the values binned; ``None``: from the
            bucket centres (the first bucket as wide as the second), the filled buckets' span.

    Example:
        >>> raw = histogram_raw(np.array([0.0, 1.0, 2.0]), np.array([0.0, 2.0, 1.0]))
        >>> raw["min"], raw["max"], raw["num"], raw["sum"]
        (0.0, 2.0, 3.0, 2.5)
    """
    if moments is None:
        lower = np.concatenate([[limits[0] - (limits[1] - limits[0])], limits[:-1]])
        centres = (lower + limits) / 2
        filled = np.flatnonzero(counts)
        moments = (
            float(lower[filled[0]]) if filled.size else 0.0,
            float(limits[filled[-1]]) if filled.size else 0.0,
            float((centres * counts).sum()),
            float((centres**2 * counts).sum()),
        )
    low, high, total, sum_sq = moments
    return {
        "min": low,
        "max": high,
        "num": float(counts.sum()),
        "sum": total,
        "sum_squares": sum_sq,
        "bucket_limits": [float(e) for e in limits],
        "bucket_counts": [float(c) for c in counts],
    }


_MASK = 0xFFFFFFFF
_DELTA = 0xA282EAD8  # TFRecord's mask: rotate right by 15 bits, add this
_value: Callable[[bytes], int] | None = None
_slow: Callable[[Any], int] | None = None


def masked_crc32c(data: Any) -> int:
    """TFRecord's masked CRC-32C of ``data``, as TensorBoard's ``masked_crc32c`` computes it;
    anything the C function does not take (or an error in it) goes to TensorBoard's own.

    Example:
        >>> from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tb
        >>> fast_tensorboard_crc() and masked_crc32c(b"123456789") == tb(b"123456789")
        True
    """
    assert _value is not None and _slow is not None, "call fast_tensorboard_crc() first"
    try:
        x = _value(data if type(data) is bytes else bytes(data))
    except Exception:
        return _slow(data)
    return (((x >> 15) | ((x << 17) & _MASK)) + _DELTA) & _MASK


@functools.cache
def fast_tensorboard_crc() -> bool:
    """Have TensorBoard's record writer use :func:`masked_crc32c`; whether it does (once)."""
    global _value, _slow
    try:
        import google_crc32c
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return False
    slow = getattr(record_writer, "masked_crc32c", None)
    if google_crc32c.implementation != "c" or not callable(slow):
        return False
    _value, _slow = google_crc32c.value, slow
    record_writer.masked_crc32c = masked_crc32c
    return True


_HEADS: dict[str, bytes] = {}
"""Each tag's bytes before its value: ``value``'s key and length, ``tag``'s key, length and
text, ``simple_value``'s key (every value's message has the same length for one tag)."""
_MOST_HEADS = 1 << 16  # tags whose bytes are kept, at most (then it starts over)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _head(tag: str) -> bytes:
    head = _HEADS.get(tag)
    if head is None:
        if len(_HEADS) >= _MOST_HEADS:
            _HEADS.clear()
        text = tag.encode("utf-8")
        field = b"\x0a" + _varint(len(text)) + text + b"\x15"  # tag: 1, length; simple_value: 2
        head = _HEADS[tag] = b"\x0a" + _varint(len(field) + 4) + field  # value: 1, length
    return head


def scalar_summary(metrics: Mapping[str, float]) -> Any:
    """``Summary(value=[Summary.Value(tag=tag, simple_value=value), ...])`` for ``metrics``.

    Example:
        >>> from tensorboard.compat.proto.summary_pb2 import Summary
        >>> metrics = {"a/b": 0.1, "é" * 70: -1e40, "n": float("nan")}
        >>> want = Summary(
        ...     value=[Summary.Value(tag=t, simple_value=v) for t, v in metrics.items()]
        ... )
        >>> scalar_summary(metrics).SerializeToString() == want.SerializeToString()
        True
    """
    from tensorboard.compat.proto.summary_pb2 import Summary

    with np.errstate(over="ignore"):  # beyond float32: infinite, as protobuf stores it
        values = np.fromiter(map(float, metrics.values()), np.float64, len(metrics))
        floats = values.astype("<f4").tobytes()
    parts = []
    for i, tag in enumerate(metrics):
        parts.append(_head(tag))
        parts.append(floats[4 * i : 4 * i + 4])
    return Summary.FromString(b"".join(parts))
