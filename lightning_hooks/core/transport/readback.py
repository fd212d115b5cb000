"""One host read-back for small device tensors (a pinned buffer, a non-blocking copy, an event),
and the first non-finite event of a run, recorded on the device and read back through it."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

__all__ = ["FirstNonFinite", "HostMailbox"]


class HostMailbox:
    """A small device tensor copied to host memory without blocking, read on a later call.

    On CUDA the host buffer is pinned, the copy ``non_blocking`` and an event marks its end
    (:meth:`read` waits only when asked); on the CPU the copy is the read. Reading is through a
    numpy view made once: no torch call, no sync. A smaller tensor than ``shape`` is read back
    in its own shape; a larger one replaces the buffer.

    Args:
        shape: the shape of the tensors posted (the largest).
        device: where they live.
        dtype: their dtype.

    Example:
        >>> box = HostMailbox((2,), torch.device("cpu"))
        >>> box.pending
        False
        >>> box.post(torch.tensor([1.0, 2.0]), meta="step 3")
        >>> view, meta = box.read(wait=False)
        >>> view.tolist(), meta, box.pending
        ([1.0, 2.0], 'step 3', False)
    """

    def __init__(
        self, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype = torch.float32
    ) -> None:
        self._cuda = device.type == "cuda"
        self._dtype = dtype
        self._event = torch.cuda.Event() if self._cuda else None  # type: ignore[no-untyped-call]
        self._meta: Any = None
        self._allocate(shape)
        self.pending = False
        """Whether a posted value has not been read yet."""

    def _allocate(self, shape: tuple[int, ...]) -> None:
        """The host buffer of ``shape`` (pinned on CUDA) and its numpy view, made once."""
        self._view: np.ndarray
        if self._cuda:
            self._host = torch.zeros(shape, dtype=self._dtype, pin_memory=True)
            self._view = self._host.numpy()
        else:  # host memory both ways: numpy's buffer, seen by torch
            dtype = np.dtype(str(self._dtype).removeprefix("torch."))
            self._view = np.zeros(shape, dtype=dtype)
            self._host = torch.from_numpy(self._view)
        self._slot: tuple[torch.Tensor, np.ndarray] = (self._host, self._view)
        self._slots = {tuple(self._host.shape): self._slot}

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the tensors it takes."""
        return tuple(self._host.shape)

    def reserve(self, shape: tuple[int, ...]) -> tuple[torch.Tensor, np.ndarray]:
        """The host buffer's views for values of ``shape``, made on first use (a new buffer
        when larger than any before); reserve ahead so the steps that post it make no view."""
        slot = self._slots.get(shape)
        if slot is None:
            count = math.prod(shape)
            if count > self._host.numel():  # larger than any before: a new buffer, once
                unread = self._slot  # a pending value stays in the old buffer until read
                self._allocate((count,))
                self._slot = unread
            host = self._host.view(-1)[:count].view(shape)
            view = self._view.reshape(-1)[:count].reshape(shape)
            slot = self._slots[shape] = (host, view)
        return slot

    def post(self, value: torch.Tensor, meta: Any = None) -> None:
        """Start copying ``value`` to the host; ``meta`` comes back with it from :meth:`read`."""
        slot = self._slots.get(tuple(value.shape)) or self.reserve(tuple(value.shape))
        self._slot = slot
        # Only CUDA gets an event to tell when a non_blocking copy is done: elsewhere, block.
        slot[0].copy_(value, non_blocking=self._event is not None)
        if self._event is not None:
            self._event.record()
        self._meta = meta
        self.pending = True

    def read(self, wait: bool) -> tuple[np.ndarray, Any] | None:
        """The posted value (a numpy view, valid until the next post) and its ``meta`` once the
        copy is done, else ``None``; ``wait``: block until it is."""
        if not self.pending:
            return None
        if self._event is not None:
            if wait:
                self._event.synchronize()
            elif not self._event.query():  # type: ignore[no-untyped-call]
                return None
        meta, self._meta = self._meta, None
        self.pending = False
        return self._slot[1], meta

    def clear(self, fill: float = 0) -> None:
        """Drop a pending value and fill the host buffer with ``fill``."""
        self._meta, self.pending = None, False
        self._view.fill(fill)


_ROW_SPACE = 1 << 24


class FirstNonFinite:
    """Which row (a module, in execution order) first produced NaN / Inf, and at which step.

    :meth:`mark` keeps the first ``(step, row)`` whose on-device flag is true in one on-device
    int64 tensor (a few tiny kernels, no host sync). :meth:`poll` reads it back through a
    :class:`HostMailbox` without waiting: on CUDA at most one step late, on the CPU at once.

    Args:
        device: the device the hooks run on.

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
        self._mailbox = HostMailbox((1,), device, torch.int64)
        self._mailbox.clear(-1)

    def mark(self, bad: torch.Tensor, step: int, row: int | torch.Tensor) -> None:
        """Record ``(step, row)`` if ``bad`` (a 0-d bool on the device) and nothing was before;
        ``row``: an int in ``[0, 2**24)`` or a 0-d int tensor on the device."""
        hit = bad & (self.code < 0)
        if isinstance(row, int):
            self.code.masked_fill_(hit, step * _ROW_SPACE + row)
        else:  # stays on the device: a Python scalar added to it is a kernel argument, no copy
            torch.where(hit, row + step * _ROW_SPACE, self.code, out=self.code)

    def poll(self) -> tuple[int, int] | None:
        """``(step, row)`` of the first mark that has reached the host, or ``None``."""
        box = self._mailbox
        got = box.read(wait=False)
        code = -1 if got is None else int(got[0][0])
        if code < 0 and not box.pending:
            box.post(self.code)  # on the CPU the copy is the read
            got = None if self.device.type == "cuda" else box.read(wait=False)
            code = -1 if got is None else int(got[0][0])
        return divmod(code, _ROW_SPACE) if code >= 0 else None

    def reset(self) -> None:
        """Forget any mark (a new run)."""
        self.code.fill_(-1)
        self._mailbox.clear(-1)
