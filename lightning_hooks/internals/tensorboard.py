"""The speed-ups over TensorBoard's private attributes (see :mod:`lightning_hooks.internals`).

They are the event files' checksums in C, and a logging step's scalars written as one event.

Each has a public twin, taken when the speed-ups are off
(:func:`~lightning_hooks.internals.speedups`): TensorBoard's own checksums, and the logger's own
``log_metrics``. The event files carry the same values either way.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from typing_extensions import Buffer

from lightning_hooks.internals import speedups
from lightning_hooks.internals.lightning import logger_prefix
from lightning_hooks.tags import TAG_CACHE_SIZE

if TYPE_CHECKING:
    from tensorboard.compat.proto.summary_pb2 import Summary

__all__ = ["Checksums", "fast_checksums", "one_event_writer", "scalar_summary"]

_MASK = 0xFFFFFFFF
_DELTA = 0xA282EAD8  # TFRecord's mask: rotate right by 15 bits, add this


class Checksums(NamedTuple):
    """TFRecord's masked CRC-32C in C, with TensorBoard's own for what the C one does not take."""

    value: Callable[[bytes], int]
    fallback: Callable[[Buffer], int]

    def masked_crc32c(self, data: Buffer) -> int:
        """Return TFRecord's masked CRC-32C of ``data``, as TensorBoard's ``masked_crc32c`` does.

        Anything the C function does not take (or an error in it) goes to the fallback.

        Args:
            data: the bytes of a record's length or of its payload.

        Returns:
            The masked checksum.
        """
        try:
            x = self.value(data if type(data) is bytes else bytes(data))
        except Exception:
            return self.fallback(data)
        return (((x >> 15) | ((x << 17) & _MASK)) + _DELTA) & _MASK


def fast_checksums(experiment: object) -> bool:
    """Speed-up: the record writer of ``experiment``'s event file computes its checksums in C.

    That writer's ``write`` becomes :func:`_write_record`, which frames each record as
    TensorBoard's ``RecordWriter.write`` does, with :meth:`Checksums.masked_crc32c`
    (``google_crc32c``, in C) in place of TensorBoard's own in pure Python. Only the writer of
    this logger's ``SummaryWriter`` is changed: TensorBoard's module and every other writer in the
    process keep their own checksums.

    Without TensorFlow, TensorBoard computes each record's CRC-32C in Python, in its writer
    thread, holding the GIL. On a 200-step fit of the stand-in with all six callbacks: 54.7 ms
    of checksums in Python against 0.4 ms in C, and a save's worst wait 11.65 ms against 0.59 ms
    (``benchmarks/tensorboard_crc.py``).

    The public twin, with the speed-ups off: TensorBoard's own checksums, nothing changed. A
    writer TensorBoard makes anew (after the ``SummaryWriter`` was closed) has its own too.

    Args:
        experiment: a ``TensorBoardLogger``'s ``SummaryWriter``.

    Returns:
        Whether its record writer computes the checksums in C (``False`` where the speed-ups are
        off, ``google_crc32c`` or its C implementation is missing, or the writer is not
        TensorBoard's ``RecordWriter``).
    """
    if not speedups():
        return False
    try:
        import google_crc32c
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return False
    if google_crc32c.implementation != "c":
        return False
    try:
        writer = _record_writer(experiment)
    except Exception:  # a writer that cannot be reached keeps TensorBoard's own checksums
        return False
    if not isinstance(writer, record_writer.RecordWriter):
        return False
    checksums = Checksums(value=google_crc32c.value, fallback=record_writer.masked_crc32c)
    writer.write = functools.partial(_write_record, writer, checksums)
    return True


def _record_writer(experiment: object) -> object:
    """Return the record writer of a ``SummaryWriter``'s event file, or ``None``.

    It is ``_get_file_writer().event_writer._async_writer._writer``: the object TensorBoard's
    writer thread calls ``write`` on for each record.
    """
    get_file_writer = getattr(experiment, "_get_file_writer", None)
    if get_file_writer is None:
        return None
    event_writer = getattr(get_file_writer(), "event_writer", None)
    async_writer = getattr(event_writer, "_async_writer", None)
    return getattr(async_writer, "_writer", None)


def _write_record(writer: object, checksums: Checksums, data: bytes) -> None:
    """Write one record as TensorBoard's ``RecordWriter.write`` does, its checksums in C.

    A TFRecord is its length (8 bytes), the length's masked CRC-32C, the data, and the data's.
    """
    header = struct.pack("<Q", len(data))
    header_crc = struct.pack("<I", checksums.masked_crc32c(header))
    footer_crc = struct.pack("<I", checksums.masked_crc32c(data))
    writer._writer.write(header + header_crc + data + footer_crc)  # type: ignore[attr-defined]


def one_event_writer(logger: object) -> Callable[[Mapping[str, float], int], None] | None:
    """Speed-up: return a writer of a logging step's scalars as one event.

    It writes through the ``SummaryWriter``'s file writer (its ``_get_file_writer()``), for a
    plain ``TensorBoardLogger`` on rank 0 with no prefix.

    The logger's own ``log_metrics`` writes one event per scalar, each with its checksums. On the
    stand-in with the six callbacks at their defaults, writing a logging step's and an epoch
    end's 2,588 scalars takes 78.8 ms that way and 8.6 ms as one event: 1.4 ms a step at
    ``log_every_n_steps=50``, 72% of a bare step (``benchmarks/speedups.py``).

    The public twin, with the speed-ups off (``None``): the logger's ``log_metrics``.

    Args:
        logger: the Lightning logger the scalars go to.

    Returns:
        The writer, called with the scalars by tag and the step; ``None`` where it does not apply
        or the speed-ups are off.
    """
    from torch.utils.tensorboard import SummaryWriter

    if not speedups() or logger_prefix(logger):
        return None
    writer = getattr(logger, "experiment", None)  # a dummy one on ranks > 0
    if not isinstance(writer, SummaryWriter):
        return None

    def write(metrics: Mapping[str, float], step: int) -> None:
        # the file writer is opened again after a close (its attribute would be None)
        file_writer = writer._get_file_writer()  # type: ignore[no-untyped-call]
        file_writer.add_summary(scalar_summary(metrics), step)

    return write


def _varint(n: int) -> bytes:
    """Return ``n`` (not negative) as protobuf's base-128 varint."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


@functools.lru_cache(maxsize=TAG_CACHE_SIZE)
def _head(tag: str) -> bytes:
    """A tag's ``Summary.Value`` bytes before its ``simple_value`` (always of the same length)."""
    text = tag.encode("utf-8")
    field = b"\x0a" + _varint(len(text)) + text + b"\x15"  # tag: 1, length; simple_value: 2
    return b"\x0a" + _varint(len(field) + 4) + field  # value: 1, length


class _Layout(NamedTuple):
    """What every event of one sequence of tags shares (a logging step writes the same ones)."""

    template: np.ndarray  # uint8: the tags' Summary.Value bytes in turn, each value's 4 zero
    slots: np.ndarray  # [tags, 4]: where each value's float32 bytes go in the template


@functools.lru_cache(maxsize=64)
def _layout(tags: tuple[str, ...]) -> _Layout:
    """Lay out the bytes of an event of ``tags``, once per sequence of tags."""
    heads = [_head(tag) for tag in tags]
    ends = np.cumsum([len(head) + 4 for head in heads], dtype=np.int64)
    template = np.frombuffer(b"".join(head + bytes(4) for head in heads), dtype=np.uint8)
    return _Layout(template=template, slots=ends[:, None] - np.arange(4, 0, -1))


def scalar_summary(metrics: Mapping[str, float]) -> Summary:
    """Return ``Summary(value=[Summary.Value(tag=tag, simple_value=value), ...])`` for ``metrics``.

    It is written in protobuf's wire format and parsed in C: faster than a ``Summary.Value`` per
    scalar, and the bytes of a sequence of tags seen before are laid out once.

    Args:
        metrics: the scalars by tag; each value is stored as a float32.

    Returns:
        The summary, one value per tag, in order.

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

    layout = _layout(tuple(metrics))
    with np.errstate(over="ignore"):  # beyond float32: infinite, as protobuf stores it
        values = np.fromiter(map(float, metrics.values()), np.float64, len(metrics))
        floats = values.astype("<f4").view(np.uint8).reshape(-1, 4)
    event = layout.template.copy()
    event[layout.slots] = floats
    return Summary.FromString(event.tobytes())
