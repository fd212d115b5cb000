"""TensorBoard event files read record by record, with their checksums: TensorBoard's own
reader stops silently at a corrupt or truncated record; this one raises
:class:`EventFileError`, naming the file and the byte offset."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["EventFileError", "scalar_events"]


class EventFileError(ValueError):
    """An event file that cannot be read to its end: a corrupt or a truncated record."""


def scalar_events(path: Path) -> Iterator[tuple[str, int, float]]:
    """``(tag, step, value)`` of every scalar in one event file, in file order.

    Every record's framing is checked (its length and the length's checksum), and so is the
    payload checksum of every record that holds a scalar.

    Raises:
        EventFileError: the file is corrupt or ends inside a record; the message names the file
            and the byte offset of the record.
    """
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto.event_pb2 import Event

    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        payload, payload_crc, end = _record(data, offset, path)
        try:
            event = Event.FromString(payload)
        except DecodeError as error:
            raise EventFileError(f"{path}: corrupt record at byte {offset} ({error})") from None
        scalars = [(v.tag, x) for v in event.summary.value if (x := _scalar(v)) is not None]
        if scalars and _masked_crc32c(payload) != payload_crc:
            raise EventFileError(f"{path}: corrupt record at byte {offset} (checksum mismatch)")
        for tag, value in scalars:
            yield tag, event.step, value
        offset = end


def _record(data: bytes, offset: int, path: Path) -> tuple[bytes, int, int]:
    """The TFRecord at ``offset``: ``(payload, payload checksum, offset of the next record)``."""
    size = len(data)
    if offset + 12 > size:
        raise EventFileError(
            f"{path}: truncated: the file ends inside the record header at byte {offset} "
            f"({size} bytes; a run still being written, or a file cut short)"
        )
    (length,) = struct.unpack_from("<Q", data, offset)
    (length_crc,) = struct.unpack_from("<I", data, offset + 8)
    if _masked_crc32c(data[offset : offset + 8]) != length_crc:
        raise EventFileError(f"{path}: corrupt record header at byte {offset} (checksum mismatch)")
    start, end = offset + 12, offset + 12 + length
    if end + 4 > size:
        raise EventFileError(
            f"{path}: truncated: the record at byte {offset} needs {length + 16} bytes, the file "
            f"ends after {size - offset} (a run still being written, or a file cut short)"
        )
    (payload_crc,) = struct.unpack_from("<I", data, end)
    return data[start:end], payload_crc, end + 4


def _masked_crc32c(data: bytes) -> int:
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    return int(masked_crc32c(data))


def _scalar(value: Any) -> float | None:
    """A summary value's scalar (``simple_value`` or a scalar-plugin tensor), else ``None``."""
    if value.HasField("simple_value"):
        return float(value.simple_value)
    if value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars":
        from tensorboard.util.tensor_util import make_ndarray

        return float(make_ndarray(value.tensor).item())
    return None
