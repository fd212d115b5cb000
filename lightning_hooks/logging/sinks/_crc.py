"""TensorBoard's event files without its pure-Python CRC-32C.

Each record of an event file carries two CRC-32C checksums. Without TensorFlow, TensorBoard's
writer computes them in pure Python, one byte at a time
(``tensorboard.summary.writer.record_writer.masked_crc32c``): about 0.27 us a byte, 140 ms for
the half megabyte that a 200-step fit of the launch-bound stand-in writes with every callback.
That runs in TensorBoard's writer thread holding the GIL the training loop needs, and on the
training thread's path at each save: a logging step's flush waits for it. ``google_crc32c``'s C
implementation gives the same checksums in well under a millisecond for the same bytes.

:func:`fast_tensorboard_crc` points TensorBoard's record writer at it, once per process, when
``google_crc32c`` is installed with its C implementation (one of our dependencies; its
pure-Python fallback is no faster, and then nothing changes). The bytes written are the same;
the readers (TensorBoard's own, which checks every checksum) see no difference.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["fast_tensorboard_crc", "masked_crc32c"]

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
