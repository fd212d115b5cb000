"""Pure functions: per-layer gradient, weight and update statistics with batched kernels.

Parameters are grouped by the module that owns them directly. Every function takes lists of
tensors and a :class:`ParamLayout`, runs a few ``torch._foreach_*`` kernels over all parameters at
once, and reduces per layer with ``index_add_``: the number of kernels does not grow with the
number of parameters, and nothing is read back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "GLOBAL",
    "GRAD_STATS",
    "ParamLayout",
    "grad_stats",
    "param_norms",
    "segment_max",
    "segment_norm",
    "update_norms",
]

GRAD_STATS = ("grad_norm", "grad_abs_mean", "grad_abs_max", "grad_nonfinite", "weight_norm")
"""Columns of :func:`grad_stats`, in order."""

GLOBAL = "global"
"""Name of the extra last row that aggregates every layer."""


@dataclass(frozen=True)
class ParamLayout:
    """Which layer each trainable parameter belongs to.

    Attributes:
        layers: layer (owning module) names, in model order.
        params: trainable parameters, grouped by layer.
        owner: layer index of each parameter, on the host.
        index: ``owner`` as a tensor on the parameters' device.
        numel: ``[layers]`` number of parameter elements per layer (float).
    """

    layers: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    owner: tuple[int, ...]
    index: torch.Tensor
    numel: torch.Tensor

    @classmethod
    def from_modules(cls, modules: Sequence[tuple[str, nn.Module]]) -> ParamLayout:
        """Group the trainable parameters owned directly by each module.

        Example:
            >>> from torch import nn
            >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
            >>> layout = ParamLayout.from_modules(list(net.named_children()))
            >>> layout.layers, layout.index.tolist(), layout.numel.tolist()
            (('0', '2'), [0, 0, 1, 1], [9.0, 4.0])
        """
        layers: list[str] = []
        params: list[nn.Parameter] = []
        index: list[int] = []
        numel: list[int] = []
        for name, module in modules:
            own = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            index.extend([len(layers)] * len(own))
            numel.append(sum(p.numel() for p in own))
            layers.append(name)
            params.extend(own)
        device = params[0].device if params else torch.device("cpu")
        return cls(
            layers=tuple(layers),
            params=tuple(params),
            owner=tuple(index),
            index=torch.tensor(index, dtype=torch.long, device=device),
            numel=torch.tensor(numel, dtype=torch.float32, device=device),
        )

    def subset(self, keep: Sequence[bool]) -> tuple[tuple[nn.Parameter, ...], torch.Tensor]:
        """Parameters where ``keep`` is true, with their layer indices."""
        picked = [i for i, k in enumerate(keep) if k]
        params = tuple(self.params[i] for i in picked)
        return params, self.index[torch.tensor(picked, dtype=torch.long, device=self.index.device)]


def segment_norm(norms: torch.Tensor, index: torch.Tensor, num_layers: int) -> torch.Tensor:
    """``[layers + 1]`` L2 norms of per-layer groups of per-parameter L2 ``norms``; last: all."""
    sq = norms.new_zeros(num_layers).index_add_(0, index, norms.square())
    return torch.cat([sq, sq.sum().view(1)]).sqrt()


def segment_max(values: torch.Tensor, index: torch.Tensor, num_layers: int) -> torch.Tensor:
    """``[layers + 1]`` per-layer maxima of ``values`` (NaN propagates); last: all."""
    peak = values.new_zeros(num_layers).scatter_reduce(0, index, values, "amax", include_self=False)
    return torch.cat([peak, values.max().view(1)])


def _segment_sum(values: torch.Tensor, index: torch.Tensor, num_layers: int) -> torch.Tensor:
    total = values.new_zeros(num_layers).index_add_(0, index, values)
    return torch.cat([total, total.sum().view(1)])


def param_norms(tensors: Sequence[torch.Tensor], ord: float = 2.0) -> torch.Tensor:
    """``[len(tensors)]`` norms of each tensor, in float32 (one multi-tensor pass)."""
    return torch.stack(torch._foreach_norm(list(tensors), ord)).float()


@torch.no_grad()
def grad_stats(
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] | None,
    index: torch.Tensor,
    numel: torch.Tensor,
    scratch: Sequence[torch.Tensor] | None = None,
    l2: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[layers + 1, len(GRAD_STATS)]`` statistics of one optimizer step's gradients.

    Rows are the layers of ``numel`` and a last row for all of them together. Columns are
    :data:`GRAD_STATS`: L2 norm, mean ``|g|``, max ``|g|``, whether any entry is non-finite (1 or
    0: summed over steps it counts the steps with a NaN/Inf gradient), weight L2 norm (NaN when
    ``params`` is ``None``). A parameter whose gradient is ``None`` is passed as a zero tensor.
    ``l2``: the per-parameter L2 norms of ``grads`` when already computed (the alarms' sentinel
    reads them every step): the L2 pass is not repeated.

    Four reading passes over the gradients and one over the weights: ``_foreach_norm`` with
    orders 1, inf and 0 takes a slow path on the CPU (10-30x the cost of order 2), so only the L2
    norms use it; ``|g|`` is written once into ``scratch`` (buffers shaped like ``grads``,
    overwritten; allocated when ``None``), then summed and maxed. The maximum propagates NaN and
    Inf, so a non-finite maximum is exactly a non-finite entry: no pass of its own.

    Example:
        >>> g = [torch.tensor([3.0, -4.0]), torch.tensor([1.0])]
        >>> w = [torch.ones(2), torch.ones(1)]
        >>> grad_stats(g, w, torch.tensor([0, 1]), torch.tensor([2.0, 1.0]))
        tensor([[5.0000, 3.5000, 4.0000, 0.0000, 1.4142],
                [1.0000, 1.0000, 1.0000, 0.0000, 1.0000],
                [5.0990, 2.6667, 4.0000, 0.0000, 1.7321]])
    """
    num_layers = numel.numel()
    l2 = param_norms(grads, 2.0) if l2 is None else l2
    absolute = [torch.empty_like(g) for g in grads] if scratch is None else list(scratch)
    sums = [torch.abs(g, out=a).sum() for g, a in zip(grads, absolute, strict=True)]
    peak = torch.stack(torch._foreach_max(absolute)).float()
    l1 = _segment_sum(torch.stack(sums).float(), index, num_layers)
    nonfinite = (~torch.isfinite(peak)).float()
    if params is None:
        weight = torch.full((num_layers + 1,), torch.nan, device=l2.device)
    else:
        weight = segment_norm(param_norms(params, 2.0), index, num_layers)
    return torch.stack(
        [
            segment_norm(l2, index, num_layers),
            l1 / torch.cat([numel, numel.sum().view(1)]),
            segment_max(peak, index, num_layers),
            segment_max(nonfinite, index, num_layers),
            weight,
        ],
        dim=1,
    )


@torch.no_grad()
def update_norms(
    before: Sequence[torch.Tensor],
    after: Sequence[torch.Tensor],
    index: torch.Tensor,
    num_layers: int,
) -> torch.Tensor:
    """``[layers + 1]`` norms of ``after - before`` per layer, last: all. Overwrites ``before``."""
    diffs = list(before)
    torch._foreach_sub_(diffs, list(after))
    return segment_norm(param_norms(diffs, 2.0), index, num_layers)
