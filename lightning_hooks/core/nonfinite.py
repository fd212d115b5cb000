"""The first non-finite event of a run, recorded on the device, read back without blocking."""

from __future__ import annotations

import torch

__all__ = ["FirstNonFinite"]

_ROW_SPACE = 1 << 24


class FirstNonFinite:
    """Which row (a module, in execution order) first produced NaN / Inf, and at which step.

    :meth:`mark`, called with an on-device "something is bad" flag (from a forward hook, or once
    per step), keeps the first ``(step, row)`` ever marked in one on-device int64 tensor: later
    marks never overwrite it. A few tiny kernels, no host sync.

    :meth:`poll` is the cheap per-step check: on CUDA it copies that tensor with
    ``non_blocking=True`` into pinned memory, records an event, and on a later call reads the
    pinned copy only once ``event.query()`` says it has landed (never waiting), so the answer
    comes at most one step late when the GPU keeps up. On a CPU device the tensor already lives
    in host memory: the copy is an 8-byte ``memcpy`` and the answer is immediate.

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
        cuda = device.type == "cuda"
        self._host = torch.full((1,), -1, dtype=torch.int64, pin_memory=cuda)
        self._view = self._host.numpy()  # shares the pinned buffer: reading it is not a sync
        self._event: torch.cuda.Event | None = None

    def mark(self, bad: torch.Tensor, step: int, row: int | torch.Tensor) -> None:
        """Record ``(step, row)`` if ``bad`` (a 0-d bool on the device) and nothing was before.

        ``row`` is an int in ``[0, 2**24)`` or a 0-d int tensor on the device.
        """
        hit = bad & (self.code < 0)
        if isinstance(row, int):
            self.code.masked_fill_(hit, step * _ROW_SPACE + row)
        else:  # stays on the device: a Python scalar added to it is a kernel argument, no copy
            torch.where(hit, row + step * _ROW_SPACE, self.code, out=self.code)

    def poll(self) -> tuple[int, int] | None:
        """``(step, row)`` of the first mark that has reached the host, or ``None``."""
        if self.device.type != "cuda":
            self._host.copy_(self.code)
            return self._decode()
        if self._event is not None and self._event.query():  # type: ignore[no-untyped-call]
            self._event = None
            found = self._decode()
            if found is not None:
                return found
        if self._event is None:
            self._host.copy_(self.code, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
        return None

    def _decode(self) -> tuple[int, int] | None:
        code = int(self._view[0])
        return None if code < 0 else divmod(code, _ROW_SPACE)

    def reset(self) -> None:
        """Forget any mark (a new run)."""
        self.code.fill_(-1)
        self._event = None
        self._view[0] = -1
