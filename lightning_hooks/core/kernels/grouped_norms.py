"""The quiet step's L2 norms of many small gradients in a handful of ops, with no op per tensor.

``torch._foreach_norm`` does its host work per tensor: on the CPU it is a loop of
``linalg_vector_norm`` calls (about 2-6 us each), on CUDA an output allocated and wrapped for
each tensor (about 3 us each on an H100's host). A small model's gradients are mostly small
tensors of a few repeated shapes (biases, norm weights, the blocks' matrices), for which that
overhead is the whole cost. Here the small gradients of one shape and dtype are stacked into one
tensor (one copy, one op, whatever their number) and reduced along its rows (one op); the rest
take one ``_foreach_norm``. Each row's reduction is the same as the tensor's own, so on the CPU
the norms equal ``_foreach_norm``'s bit for bit (``tests/test_grouped_norms.py``); on CUDA,
within float32 rounding (``tests/test_cuda.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter, itemgetter

import torch

from lightning_hooks.core.kernels.tensors import row_index

__all__ = ["MAX_GROUPS", "MIN_GROUP", "SMALL", "GroupedNorms", "cpu_grouping"]

SMALL = 8192
"""Elements: a tensor this small is read in a stack (copying it costs less than its own op)."""
MAX_GROUPS = 6
"""Stacks at most: 2 ops each, so that a quiet step's ops stay a handful whatever the model."""
MIN_GROUP = {"cpu": 3, "cuda": 12}
"""Gradients a stack holds at least, per device type (others: CUDA's). A stack costs two ops
and saves each gradient its own: on the CPU an op costs about what a gradient costs
``_foreach_norm``; on an H100's host about 3-4 gradients' worth (``benchmarks/graph_probe.py``:
stacks of 4 made the read slower)."""


_SumMax = tuple[torch.Tensor, torch.Tensor]


class GroupedNorms:
    """Reads the L2 norms of the gradients of fixed ``params``, in parameter order.

    The groups are made once, from the parameters' shapes, dtypes and devices (a dense gradient
    has its parameter's): the :data:`MAX_GROUPS` largest sets of non-scalar parameters of at
    most :data:`SMALL` elements that share all three, of at least :data:`MIN_GROUP` (3 on the
    CPU, 12 on CUDA). A call runs the same Python whatever the number of tensors or groups
    (their gradients are picked by ``operator.itemgetter``): no frame per group, none per tensor.

    Args:
        params: the parameters whose gradients each call reads, in order.

    Example:
        >>> params = [torch.ones(3), torch.ones(2, 2), torch.ones(3), torch.ones(5), torch.ones(3)]
        >>> read = GroupedNorms(params)
        >>> read.groups, read.rest
        ([[0, 2, 4]], [1, 3])
        >>> grads = [torch.full((3,), 2.0), torch.ones(2, 2), torch.zeros(3), torch.ones(5)]
        >>> read([*grads, torch.ones(3)])
        tensor([3.4641, 2.0000, 0.0000, 2.2361, 1.7321])
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        kinds: dict[tuple[torch.Size, torch.dtype, torch.device], list[int]] = {}
        for i, p in enumerate(params):
            if p.dim() > 0 and 0 < p.numel() <= SMALL:
                kinds.setdefault((p.shape, p.dtype, p.device), []).append(i)
        least = MIN_GROUP.get(params[0].device.type, MIN_GROUP["cuda"]) if len(params) else 0
        sets = sorted([g for g in kinds.values() if len(g) >= least], key=len, reverse=True)
        self.groups: list[list[int]] = sets[:MAX_GROUPS]
        """Positions of the gradients read in each stack (none: one ``_foreach_norm``)."""
        grouped = {i for g in self.groups for i in g}
        self.rest: list[int] = [i for i in range(len(params)) if i not in grouped]
        """Positions of the gradients read by one ``_foreach_norm``."""
        self._stacks = [
            (itemgetter(*g), tuple(range(1, params[g[0]].dim() + 1))) for g in self.groups
        ]
        # a getter of one position gives the tensor, not a tuple: that one is read twice, and
        # its second norm is left out by the index
        twice = self.rest * 2 if len(self.rest) == 1 else self.rest
        self._rest = itemgetter(*twice) if twice else None
        order = [i for g in self.groups for i in g] + self.rest
        where = [0] * len(order)
        for position, i in enumerate(order):
            where[i] = position
        self._index = row_index(where, params[0].device) if self.groups else None

    def __call__(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[len(grads)]`` L2 norms of ``grads`` (the parameters' gradients, in order), each in
        its gradient's dtype, promoted to a common one where they differ."""
        if self._index is None:  # no stack
            return torch.stack(torch._foreach_norm(list(grads)))
        parts = []
        for pick, dims in self._stacks:
            parts.append(torch.linalg.vector_norm(torch.stack(pick(grads)), dim=dims))
        if self._rest is not None:
            parts.append(torch.stack(torch._foreach_norm(self._rest(grads))))
        return torch.cat(parts).index_select(0, self._index)

    def abs_sum_max(
        self, tensors: Sequence[torch.Tensor], rest: Callable[[list[torch.Tensor]], _SumMax]
    ) -> _SumMax:
        """``[len(tensors)]`` sums and maxima of ``|t|`` in float32 (float64's summed in float64):
        each stack's ``|t|`` taken in place and reduced along its rows (three ops; no order-1 or
        order-inf norm, which take a slow path on the CPU), the rest by ``rest``."""
        if self._index is None:
            return rest(list(tensors))
        sums, peaks = [], []
        for pick, _ in self._stacks:
            stack = torch.stack(pick(tensors))
            flat = stack.abs_().view(len(stack), -1)
            wide = flat.dtype == torch.float64
            sums.append(flat.sum(1, dtype=None if wide else torch.float32).float())
            peaks.append(flat.amax(1).float())
        if self._rest is not None:
            sum_rest, peak_rest = rest(list(self._rest(tensors)))
            sums.append(sum_rest)
            peaks.append(peak_rest)
        return torch.cat(sums).index_select(0, self._index), torch.cat(peaks).index_select(
            0, self._index
        )


_SHAPE, _DTYPE, _DEVICE = attrgetter("shape"), attrgetter("dtype"), attrgetter("device")
_CPU = torch.device("cpu")
_GROUPINGS: dict[tuple[object, ...], GroupedNorms | None] = {}
"""The groupings :func:`cpu_grouping` made, by the tensors' shapes and dtypes."""


def cpu_grouping(tensors: Sequence[torch.Tensor]) -> GroupedNorms | None:
    """A :class:`GroupedNorms` for tensors of these shapes and dtypes, all on the CPU, made once
    and kept (a sampled step's reads: the weights, the gradients' ``|g|``, the updates), or
    ``None`` when they are elsewhere or none would be stacked.

    On the CPU ``_foreach_norm`` is a loop of one op per tensor, and slow for orders 1 and inf;
    off it, the multi-tensor kernels are left as they are.

    Example:
        >>> grouping = cpu_grouping([torch.ones(3), torch.ones(3), torch.ones(3), torch.ones(9)])
        >>> grouping.groups, grouping.rest
        ([[0, 1, 2]], [3])
        >>> cpu_grouping([torch.ones(3), torch.ones(9)]) is None  # nothing to stack
        True
    """
    if not tensors or set(map(_DEVICE, tensors)) != {_CPU}:
        return None
    key = (*map(_SHAPE, tensors), *map(_DTYPE, tensors))
    found = _GROUPINGS.get(key)
    if found is None:
        if len(_GROUPINGS) >= 16:  # a model whose shapes keep changing: keep a few
            _GROUPINGS.clear()
        try:
            found = GroupedNorms(tensors)
        except Exception:  # the multi-tensor read gives the same numbers: nothing to say
            found = None
        _GROUPINGS[key] = found
    return found if found is not None and found.groups else None
