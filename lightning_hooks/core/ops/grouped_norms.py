"""Reads of many tensors in a handful of ops.

The reads: L2 norms, ``|t|`` sums and maxima, an update's typical size.

Small tensors of one shape are stacked, because for many small gradients the per-tensor host
work of ``_foreach_norm`` is the whole cost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import attrgetter, itemgetter

import torch

from lightning_hooks.core.ops.tensors import Workspace, foreach_norm, piece_size, row_index

__all__ = [
    "CHUNK",
    "MAX_GROUPS",
    "MIN_GROUP",
    "SMALL",
    "GroupedNorms",
    "abs_sum_max",
    "cpu_grouping",
    "typical_update",
]

SMALL = 8192  # elements: a tensor this small is read in a stack (cheaper than its own op)
MAX_GROUPS = 6  # stacks at most, 2 ops each: a quiet step's ops stay a handful
MIN_GROUP = {"cpu": 3, "cuda": 12}  # gradients a stack holds at least (other devices: CUDA's)

_SumMax = tuple[torch.Tensor, torch.Tensor]


class GroupedNorms:
    """Computes the L2 norms of the gradients of a fixed list of ``params``.

    Small gradients that share a shape, dtype and device are stacked and read by one op per
    stack (at most :data:`MAX_GROUPS` stacks); each other gradient is read by
    ``torch._foreach_norm``. On the CPU the norms are bit for bit those ``_foreach_norm`` gives
    for every gradient.

    Args:
        params: the parameters, whose shapes, dtypes and devices fix the stacks.
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        kinds: dict[tuple[torch.Size, torch.dtype, torch.device], list[int]] = {}
        for i, p in enumerate(params):
            if p.dim() > 0 and 0 < p.numel() <= SMALL:
                kinds.setdefault((p.shape, p.dtype, p.device), []).append(i)
        least = MIN_GROUP.get(params[0].device.type, MIN_GROUP["cuda"]) if len(params) else 0
        sets = sorted([g for g in kinds.values() if len(g) >= least], key=len, reverse=True)
        self.groups: list[list[int]] = sets[:MAX_GROUPS]  # positions read in each stack
        grouped = {i for g in self.groups for i in g}
        self.rest: list[int] = [i for i in range(len(params)) if i not in grouped]
        self._stacks = [
            (itemgetter(*g), tuple(range(1, params[g[0]].dim() + 1))) for g in self.groups
        ]
        # a getter of one position gives a tensor, not a tuple: read it twice, index out one
        twice = self.rest * 2 if len(self.rest) == 1 else self.rest
        self._rest = itemgetter(*twice) if twice else None
        order = [i for g in self.groups for i in g] + self.rest
        where = sorted(range(len(order)), key=order.__getitem__)  # each gradient's position
        self._index = row_index(where, params[0].device) if self.groups else None

    def __call__(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """Return the L2 norms of the parameters' gradients.

        Args:
            grads: the gradients, in parameter order.

        Returns:
            ``[len(grads)]`` norms, in the gradients' (promoted) dtype.
        """
        if self._index is None:  # no stack
            return torch.stack(foreach_norm(list(grads)))
        parts = []
        for pick, dims in self._stacks:  # a loop: a comprehension is a Python call of its own
            parts.append(torch.linalg.vector_norm(torch.stack(pick(grads)), dim=dims))
        if self._rest is not None:
            parts.append(torch.stack(foreach_norm(self._rest(grads))))
        return torch.cat(parts).index_select(0, self._index)

    def abs_sum_max(self, tensors: Sequence[torch.Tensor], ws: Workspace) -> _SumMax:
        """Return :func:`abs_sum_max` of ``tensors``, each stack in three ops.

        No order-1 or -inf norm is taken.

        Args:
            tensors: the tensors, in parameter order.
            ws: the reader's workspace, through which a large tensor is read in pieces.

        Returns:
            ``[len(tensors)]`` float32 sums and maxima of ``|t|``.
        """
        if self._index is None:
            return _abs_sum_max(tensors, ws)
        sums = []
        peaks = []
        for pick, _ in self._stacks:
            stack = torch.stack(pick(tensors))
            flat = stack.abs_().view(len(stack), -1)
            wide = flat.dtype == torch.float64
            sums.append(flat.sum(1, dtype=None if wide else torch.float32).float())
            peaks.append(flat.amax(1).float())
        if self._rest is not None:
            sum_rest, peak_rest = _abs_sum_max(self._rest(tensors), ws)
            sums.append(sum_rest)
            peaks.append(peak_rest)
        index = self._index
        return torch.cat(sums).index_select(0, index), torch.cat(peaks).index_select(0, index)


_SHAPE = attrgetter("shape")
_DTYPE = attrgetter("dtype")
_DEVICE = attrgetter("device")
_CPU = torch.device("cpu")


def cpu_grouping(
    tensors: Sequence[torch.Tensor], workspace: Workspace | None
) -> GroupedNorms | None:
    """Find the stacks of a grouped read of these CPU tensors, made once per ``workspace``.

    Args:
        tensors: the tensors read together, every step in the same shapes and dtypes.
        workspace: the reader's workspace, which keeps the stacks from one step to the next
            (``None``: no stack; the multi-tensor read gives the same numbers).

    Returns:
        The stacks, or ``None`` where none would be stacked (off the CPU, or too few alike).
    """
    if workspace is None or not tensors or set(map(_DEVICE, tensors)) != {_CPU}:
        return None
    groupings = workspace.groupings
    key = (*map(_SHAPE, tensors), *map(_DTYPE, tensors))
    found = groupings.get(key, False)
    if found is False:
        if len(groupings) >= 16:  # a model whose shapes keep changing: keep a few
            groupings.clear()
        try:
            found = GroupedNorms(tensors)
        except Exception:  # the multi-tensor read gives the same numbers: nothing to say
            found = None
        groupings[key] = found
    return found if found is not None and found.groups else None


CHUNK = 1 << 20  # elements of |g| written at a time on the CPU (stays in cache)

_MULTI_TENSOR = 1 << 14  # up to this size, one multi-tensor call: small heap allocations


def abs_sum_max(
    tensors: Sequence[torch.Tensor], workspace: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the float32 sums and maxima of ``|t|`` of each tensor.

    An empty tensor gives 0 and 0; NaN propagates.

    Args:
        tensors: the tensors read.
        workspace: the reader's workspace (the same one every step), through which a large tensor
            is read in pieces.

    Returns:
        ``[len(tensors)]`` sums and ``[len(tensors)]`` maxima.
    """
    grouping = cpu_grouping(tensors, workspace)
    ws = workspace or Workspace()
    return _abs_sum_max(tensors, ws) if grouping is None else grouping.abs_sum_max(tensors, ws)


def _abs_sum_max(
    tensors: Sequence[torch.Tensor], ws: Workspace
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the sums and maxima of ``|t|``, small tensors in multi-tensor passes."""
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for wide in (False, True):  # float64 in float64 (then float32), the others in float32
        small = [
            i
            for i, t in enumerate(tensors)
            if 0 < t.numel() <= _MULTI_TENSOR and (t.dtype == torch.float64) == wide
        ]
        if small:  # the L1 and L-inf norms: two multi-tensor passes, no |t|, no op per tensor
            picked = [tensors[i] for i in small]
            dtype = None if wide else torch.float32
            sums = foreach_norm(picked, 1, dtype=dtype)
            peaks = foreach_norm(picked, math.inf, dtype=dtype)
            done.update(zip(small, zip(sums, peaks, strict=True), strict=True))
    pairs = [done[i] if i in done else _abs_sum_max_pieces(t, ws) for i, t in enumerate(tensors)]
    if not pairs:
        return torch.zeros(0), torch.zeros(0)
    return torch.stack([s for s, _ in pairs]).float(), torch.stack([m for _, m in pairs]).float()


def _abs_sum_max_pieces(t: torch.Tensor, ws: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the sum and maximum of ``|t|`` of one tensor, read in pieces through ``ws``."""
    if t.numel() == 0:
        zero = t.new_zeros((), dtype=torch.float32)
        return zero, zero
    flat = t.reshape(-1)
    chunk = piece_size(t.device, CHUNK)
    buf = ws.get(min(flat.numel(), chunk), t.dtype, t.device)
    parts = []
    for start in range(0, flat.numel(), chunk):
        piece = torch.abs(flat[start : start + chunk], out=buf[: min(chunk, flat.numel() - start)])
        parts.append(torch.stack([piece.sum(dtype=torch.float32), piece.max().float()]))
    both = torch.stack(parts)
    return both[:, 0].sum(), both[:, 1].max()


_TYPICAL_SAMPLE = 1024  # entries read per tensor by typical_update


@torch.no_grad()
def typical_update(
    before: Sequence[torch.Tensor],
    after: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Return the median ``|after - before|`` over about 1,024 strided entries per tensor.

    No host sync.

    Args:
        before: the parameters before the step.
        after: the parameters after the step.
        grads: the step's gradients; when given, only entries with a nonzero gradient count.

    Returns:
        The median, a tensor.
    """
    picks = []
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        grad = None if grads is None else grads[i]
        if _stackable(old, new, grad):  # small and plain: read with its shape's others
            kind = None if grad is None else grad.dtype
            groups.setdefault((new.shape, new.dtype, new.device, kind), []).append(i)
        else:
            flat = None if grad is None else grad.flatten()
            picks.append(_pick(old.flatten(), new.flatten(), flat, grads is not None))
    for rows in groups.values():
        old, new = (torch.stack([t[i] for i in rows]).flatten(1) for t in (before, after))
        got = None if grads is None else [grads[i] for i in rows]
        grad = None if got is None or got[0] is None else torch.stack(got).flatten(1)  # type: ignore[arg-type]
        picks.append(_pick(old, new, grad, grads is not None).flatten())
    return torch.cat(picks).nanmedian()


def _stackable(old: torch.Tensor, new: torch.Tensor, grad: torch.Tensor | None) -> bool:
    """Return whether a parameter's before, after and gradient can be stacked with others."""
    plain = type(new) is torch.Tensor and type(old) is torch.Tensor and not new.is_sparse
    if not plain or not 0 < new.numel() <= SMALL or old.shape != new.shape:
        return False
    return grad is None or (type(grad) is torch.Tensor and grad.shape == new.shape)


def _pick(
    old: torch.Tensor, new: torch.Tensor, grad: torch.Tensor | None, masked: bool
) -> torch.Tensor:
    """Return strided ``|new - old|``.

    NaN where ``grad`` is zero (everywhere if ``masked`` without a ``grad``).
    """
    stride = max(1, new.shape[-1] // _TYPICAL_SAMPLE)
    pick = torch.sub(new[..., ::stride], old[..., ::stride]).float().abs_()
    if grad is not None:
        return pick.masked_fill_(grad[..., ::stride] == 0, torch.nan)
    return pick.fill_(torch.nan) if masked else pick
