"""The first non-finite event of a run, recorded on the device, read back without blocking."""

from __future__ import annotations

import torch

from lightning_hooks.core.transport.readback import HostMailbox

__all__ = ["FirstNonFinite"]

_ROW_SPACE = 1 << 24


class FirstNonFinite:
    """Which row (a module, in execution order) first produced NaN / Inf, and at which step.

    :meth:`mark`, called with an on-device "something is bad" flag (from a forward hook, or once
    per step), keeps the first ``(step, row)`` ever marked in one on-device int64 tensor: later
    marks never overwrite it. A few tiny kernels, no host sync.

    :meth:`poll` is the cheap per-step check, through the shared
    :class:`~.readback.HostMailbox`: on CUDA it copies that tensor with
    ``non_blocking=True`` into pinned memory and, on a later call, reads the copy only once it
    has landed (never waiting), so the answer comes at most one step late when the GPU keeps up.
    On a CPU device the copy is an 8-byte ``memcpy`` and the answer is immediate.

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
        got = self._mailbox.read(wait=False)
        if got is not None:
            code = int(got[0][0])
            if code >= 0:
                return divmod(code, _ROW_SPACE)
        if not self._mailbox.pending:
            self._mailbox.post(self.code)
            got = None if self.device.type == "cuda" else self._mailbox.read(wait=False)
            if got is not None and int(got[0][0]) >= 0:
                return divmod(int(got[0][0]), _ROW_SPACE)
        return None

    def reset(self) -> None:
        """Forget any mark (a new run)."""
        self.code.fill_(-1)
        self._mailbox.clear(-1)
