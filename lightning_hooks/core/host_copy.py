"""Values measured on the device, read on the host without a host sync.

A :class:`HostCopy` copies a small device tensor into pinned host memory without blocking and
hands it back at a later read; :class:`FirstNonFinite` keeps the step and row of the first NaN
or Inf on the device and reads it back the same way.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np
import torch

__all__ = ["FirstNonFinite", "HostCopy", "HostSlot"]


class HostSlot(NamedTuple):
    """Host memory for one shape of posted value: a tensor and a numpy array over its bytes."""

    tensor: torch.Tensor  # what the device copies into
    array: np.ndarray  # what the host reads


class HostCopy:
    """A small device tensor copied to pinned host memory without blocking, read on a later call.

    Args:
        shape: the shape of the host buffer made at once (:meth:`reserve` adds others).
        device: the device the posted values live on; on CUDA the host memory is pinned and the
            copy is awaited with an event.
        dtype: the dtype of the host buffer and of the values posted.
    """

    def __init__(
        self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32
    ) -> None:
        self._cuda = device.type == "cuda"
        self._dtype = dtype
        self._event = torch.cuda.Event() if self._cuda else None  # type: ignore[no-untyped-call]
        self._meta: Any = None
        self._allocate(shape)
        self._posted = self._slots[tuple(shape)]
        """The slot of the value posted last, which :meth:`read` returns."""
        self.pending = False

    def _allocate(self, shape: tuple[int, ...]) -> None:
        """Make a host buffer of ``shape``, the torch and numpy views over it, and its slot.

        The slots of the old buffer are dropped; a value posted in one stays readable.
        """
        if self._cuda:
            self._host = torch.zeros(shape, dtype=self._dtype, pin_memory=True)
            self._view = self._host.numpy()
        else:  # host memory both ways: numpy's buffer, seen by torch (no Tensor.numpy call)
            dtype = np.dtype(str(self._dtype).removeprefix("torch."))
            self._view = np.zeros(shape, dtype=dtype)
            self._host = torch.from_numpy(self._view)
        self._slots = {tuple(self._host.shape): HostSlot(tensor=self._host, array=self._view)}

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the host buffer."""
        return tuple(self._host.shape)

    def reserve(self, shape: tuple[int, ...]) -> HostSlot:
        """Return the host views for values of ``shape``, made once.

        A caller reserves its shapes ahead, so that :meth:`post` never allocates. If the buffer
        must grow, a value posted and not yet read stays in the old buffer until it is read.

        Args:
            shape: the shape of the values to be posted.

        Returns:
            The slot whose tensor the device copies into and whose array the host reads.
        """
        if shape in self._slots:
            return self._slots[shape]
        count = math.prod(shape)
        if count > self._host.numel():
            self._allocate((count,))
        host = self._host.view(-1)[:count].view(shape)
        array = self._view.reshape(-1)[:count].reshape(shape)
        self._slots[shape] = HostSlot(tensor=host, array=array)
        return self._slots[shape]

    def post(self, value: torch.Tensor, meta: Any = None) -> None:  # noqa: ANN401 (the caller's record, handed back with the value)
        """Start copying ``value`` to the host.

        A value posted while another is still pending replaces it: a caller reads first.

        Args:
            value: the device tensor to copy.
            meta: the caller's record, which comes back with the value from :meth:`read`.
        """
        slot = self._slots.get(tuple(value.shape)) or self.reserve(tuple(value.shape))
        self._posted = slot
        slot.tensor.copy_(value, non_blocking=self._event is not None)
        if self._event is not None:
            self._event.record()
        self._meta = meta
        self.pending = True

    def read(self, wait: bool) -> tuple[np.ndarray, Any] | None:
        """Return the posted value and its ``meta`` once copied.

        Args:
            wait: block until the copy is done, rather than return ``None`` while it is not.

        Returns:
            The posted value (a numpy view, valid until the next post) and its ``meta``, or
            ``None`` if nothing is posted or the copy is not done.
        """
        if not self.pending:
            return None
        if self._event is not None:
            if wait:
                self._event.synchronize()
            elif not self._event.query():  # type: ignore[no-untyped-call]
                return None
        meta = self._meta
        self._meta = None
        self.pending = False
        return self._posted.array, meta

    def clear(self, fill: float = 0) -> None:
        """Drop a pending value and fill the host buffer.

        Args:
            fill: the value the host buffer is filled with.
        """
        self._meta = None
        self.pending = False
        self._view.fill(fill)


_ROW_SPACE = 1 << 24
"""A :class:`FirstNonFinite` mark packs a step and a row into one integer,
``step * _ROW_SPACE + row`` (``-1``: none yet), so one device write records both."""


def _code(got: tuple[np.ndarray, Any] | None) -> int:
    """Return the mark a :class:`FirstNonFinite` read back (``-1``: none, or nothing read)."""
    if got is None:
        return -1
    value, _ = got
    return int(value[0])


class FirstNonFinite:
    """The step and row (a module, in execution order) of the first NaN / Inf.

    Kept on ``device`` and polled without waiting (on CUDA at most one step late).

    Args:
        device: the device the mark is kept on (that of the tensors checked).

    Example:
        >>> watch = FirstNonFinite(torch.device("cpu"))
        >>> watch.mark(torch.tensor(False), step=3, row=0)
        >>> watch.mark(torch.tensor(True), step=4, row=2)
        >>> watch.mark(torch.tensor(True), step=4, row=5)
        >>> watch.poll()
        (4, 2)
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.code = torch.full((1,), -1, dtype=torch.int64, device=device)
        self._host_copy = HostCopy((1,), device, torch.int64)
        self._host_copy.clear(-1)
        self.taken = False
        """Whether :meth:`take` has returned the mark."""

    def mark(self, bad: torch.Tensor, step: int, row: int | torch.Tensor) -> None:
        """Record ``(step, row)`` if ``bad`` is the first non-finite event.

        Args:
            bad: a 0-d bool tensor, true where a NaN / Inf was found.
            step: the step recorded.
            row: the row recorded (a module, in execution order): an int < 2**24, or a 0-d
                device tensor.
        """
        hit = bad & (self.code < 0)
        if isinstance(row, int):
            self.code.masked_fill_(hit, step * _ROW_SPACE + row)
        else:  # a Python scalar added to a device tensor is a kernel argument, no copy
            torch.where(hit, row + step * _ROW_SPACE, self.code, out=self.code)

    def poll(self) -> tuple[int, int] | None:
        """Poll the first mark without waiting.

        Returns:
            The ``(step, row)`` of the first mark that has reached the host, or ``None``.
        """
        host_copy = self._host_copy
        code = _code(host_copy.read(wait=False))
        if code < 0 and not host_copy.pending:
            # Nothing has arrived and no copy is on its way: start one (on the CPU it is read
            # at once; on CUDA at a later poll).
            host_copy.post(self.code)
            code = -1 if self.device.type == "cuda" else _code(host_copy.read(wait=False))
        return divmod(code, _ROW_SPACE) if code >= 0 else None

    def take(self) -> tuple[int, int] | None:
        """Poll the first mark without waiting, and return it once only.

        Returns:
            The ``(step, row)`` of the first mark the first time it has reached the host; then,
            and before it, ``None``.

        Example:
            >>> watch = FirstNonFinite(torch.device("cpu"))
            >>> watch.mark(torch.tensor(True), step=4, row=2)
            >>> watch.take(), watch.take(), watch.taken
            ((4, 2), None, True)
        """
        if self.taken:
            return None
        found = self.poll()
        self.taken = found is not None
        return found

    def reset(self) -> None:
        """Forget any mark (a new run)."""
        self.code.fill_(-1)
        self._host_copy.clear(-1)
