"""Each gradient's L2 norm, computed in two Triton kernels.

The kernels find the tensors through a table of their addresses written each step, without
``_foreach_norm``'s per-tensor host work (no atomics: the same gradients give the same bits).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_hooks.core.ops.tensors import foreach_norm

__all__ = ["SPAN", "PointerNorms", "available"]

SPAN = 1 << 16  # elements one program of the first kernel sums
_BLOCK = 1024  # elements per load
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available() -> str | None:
    """Check whether Triton can be imported.

    Returns:
        ``None`` when Triton can be imported, else why not (for the caller's one message).
    """
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"the triton package cannot be imported ({error})"
    return None


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """Import the two Triton kernels once, on first use."""
    from lightning_hooks.core.ops import _pointer_kernels

    return _pointer_kernels.partial_sums, _pointer_kernels.norms


class PointerNorms:
    """Computes the float32 L2 norms of the gradients of ``params`` in two launches.

    One launch sums squares over spans of :data:`SPAN`, one adds each tensor's spans.

    Args:
        params: the parameters whose gradients are read; their dtype, device and layout fix the
            kernels' tables.

    Raises:
        ValueError: the parameters are not contiguous, on one device, of one dtype among float32,
            bfloat16 and float16.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES or len(devices) != 1:
            raise ValueError(f"one dtype of {_DTYPES} on one device, got {dtypes} on {devices}")
        if not all(p.is_contiguous() for p in params):
            raise ValueError("contiguous parameters (their gradients follow their layout)")
        self.device = next(iter(devices))
        self._kind = _DTYPES.index(next(iter(dtypes)))  # the kernels' constexpr
        numels = [p.numel() for p in params]
        spans = [(t, s, min(n, s + SPAN)) for t, n in enumerate(numels) for s in range(0, n, SPAN)]
        first = [0, *itertools.accumulate(math.ceil(n / SPAN) for n in numels)]
        self._pin = self.device.type == "cuda"
        # pinned and copied without blocking: building it makes no host sync either
        columns = [[span[i] for span in spans] for i in range(3)]
        table = torch.tensor(columns, dtype=torch.int64, pin_memory=self._pin)
        on_device = table.to(self.device, non_blocking=True)
        self._owner = on_device[0]  # which output each span sums into
        self._begin = on_device[1]  # where each span begins in its tensor
        self._end = on_device[2]  # and where it ends
        first_host = torch.tensor(first, dtype=torch.int64, pin_memory=self._pin)
        self._first = first_host.to(self.device, non_blocking=True)
        self._partial = torch.empty(len(spans), dtype=torch.float32, device=self.device)
        self._out = torch.empty(len(numels), dtype=torch.float32, device=self.device)

    def __call__(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """Return the L2 norms of ``grads``.

        Args:
            grads: the parameters' gradients, in parameter order.

        Returns:
            The float32 norms, overwritten by the next call; computed by ``_foreach_norm`` when one
            gradient is not contiguous (a gradient set by hand).
        """
        if not all(g.is_contiguous() for g in grads):
            return torch.stack(foreach_norm(list(grads)))
        # a fresh pinned table: PyTorch's host allocator reuses it only once its copy is done
        ptrs = torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64, pin_memory=self._pin)
        ptrs = ptrs.to(self.device, non_blocking=True)
        partial_sums, norms = _kernels()
        if len(self._partial):
            partial_sums[(len(self._partial),)](
                ptrs, self._owner, self._begin, self._end, self._partial, _BLOCK, self._kind
            )
        norms[(len(self._out),)](self._partial, self._first, self._out, _BLOCK, self._kind)
        return self._out
