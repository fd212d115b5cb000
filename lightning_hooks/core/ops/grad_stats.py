"""Per-layer gradient, weight and update statistics.

They take a few multi-tensor reads, reduced per layer (:class:`ParamLayout`) on the device, and
read nothing back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import cast

import torch
from torch import nn

from lightning_hooks import internals
from lightning_hooks.core.ops.grouped_norms import abs_sum_max, cpu_grouping
from lightning_hooks.core.ops.tensors import Workspace, foreach_norm
from lightning_hooks.core.sharding import ShardPlan, to_local

__all__ = [
    "GRADIENT_STATS",
    "GRAD_STATS",
    "LINEAR_IN_GRADIENT",
    "NORM",
    "OF_GRADIENT",
    "ROOT",
    "WEIGHT",
    "LayerIndex",
    "ParamLayout",
    "grad_stats",
    "param_norms",
    "plain_grads",
    "segment_norm",
    "update_norms",
]


GRADIENT_STATS = ("grad_norm", "grad_abs_mean", "grad_abs_max", "grad_nonfinite")
"""The columns of :func:`grad_stats` measured of the gradient, in order."""
GRAD_STATS = (*GRADIENT_STATS, "weight_norm")
"""Columns of :func:`grad_stats`, in order: the gradient's, then the weight's norm."""
OF_GRADIENT = slice(0, len(GRADIENT_STATS))
"""The columns of :data:`GRAD_STATS` measured of the gradient: a layer with none has no value."""
WEIGHT = GRAD_STATS.index("weight_norm")
"""The column of the weight's L2 norm, after the gradient's."""
NORM = GRAD_STATS.index("grad_norm")
"""The column of the gradient's L2 norm."""
LINEAR_IN_GRADIENT = slice(NORM, GRAD_STATS.index("grad_abs_max") + 1)
"""The columns a loss scale multiplies: ``grad_norm``, ``grad_abs_mean``, ``grad_abs_max``."""
ROOT = "<root>"  # row name of the parameters the model itself owns
_GRAD = attrgetter("grad")
_IS_SPARSE = attrgetter("is_sparse")
_PLAIN = {torch.Tensor}


def plain_grads(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor] | None:
    """Return each parameter's gradient when every one is a plain dense tensor.

    Args:
        params: the parameters.

    Returns:
        The gradients, or ``None`` where one is not a plain dense tensor.
    """
    plain = list(map(_GRAD, params))
    # None is NoneType's and a DTensor its own type: only dense tensors are plain Tensors
    if set(map(type, plain)) - _PLAIN or any(map(_IS_SPARSE, plain)):
        return None
    return cast("list[torch.Tensor]", plain)


@dataclass(frozen=True)
class ParamLayout:
    """The layer that each parameter belongs to.

    A layer is a module owning parameters directly, or the model: :data:`ROOT`. Every parameter is
    listed, trainable or not, a tied one once per owner (``first``: whether a listing is the
    parameter's first, which global figures count).

    Attributes:
        layers: layer names, in model order.
        params: the parameters, grouped by layer.
        owner: layer index of each listed parameter; ``index``: the same on their device.
        numel: ``[layers]`` number of parameter elements per layer (float).
    """

    layers: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    owner: tuple[int, ...]
    index: torch.Tensor
    numel: torch.Tensor
    first: tuple[bool, ...] = ()

    @classmethod
    def from_modules(
        cls, modules: Sequence[tuple[str, nn.Module]], *, root: nn.Module | None = None
    ) -> ParamLayout:
        """Group the parameters owned directly by each module (and by ``root``, first).

        Args:
            modules: ``(name, module)`` of each layer, in model order.
            root: the model, whose own parameters form the layer :data:`ROOT`.

        Returns:
            The layout.

        Example:
            >>> net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
            >>> layout = ParamLayout.from_modules(list(net.named_children()))
            >>> layout.layers, layout.index.tolist(), layout.numel.tolist()
            (('0', '2'), [0, 0, 1, 1], [9.0, 4.0])
            >>> net[2].weight = net[0].weight = nn.Parameter(torch.ones(3, 3))  # tied
            >>> ParamLayout.from_modules(list(net.named_children())).first
            (True, True, False, True)
        """
        named = [*([(ROOT, root)] if root is not None else []), *modules]
        owned = []
        for n, m in named:
            own = list(m.parameters(recurse=False))
            if own:
                owned.append((n, own))
        params = [p for _, own in owned for p in own]
        index = [row for row, (_, own) in enumerate(owned) for _ in own]
        firsts = {id(p): i for i, p in reversed(list(enumerate(params)))}
        numel = [sum(p.numel() for p in own) for _, own in owned]
        device = params[0].device if params else torch.device("cpu")
        return cls(
            layers=tuple(name for name, _ in owned),
            params=tuple(params),
            owner=tuple(index),
            index=torch.tensor(index, dtype=torch.long, device=device),
            numel=torch.tensor(numel, dtype=torch.float32, device=device),
            first=tuple(firsts[id(p)] == i for i, p in enumerate(params)),
        )

    @property
    def layer_index(self) -> LayerIndex:
        """Return how :func:`grad_stats` adds each parameter into its layer (every listing counts).

        Returns:
            The layer index of every listing.
        """
        return LayerIndex(self.index, self.numel)

    def subset(self, keep: Sequence[bool]) -> tuple[tuple[nn.Parameter, ...], torch.Tensor]:
        """Return the parameters where ``keep`` is true, with their layer indices.

        Args:
            keep: whether each listed parameter is kept.

        Returns:
            The kept parameters and their layer indices.
        """
        picked = [i for i, k in enumerate(keep) if k]
        params = tuple(self.params[i] for i in picked)
        return params, self.index[torch.tensor(picked, dtype=torch.long, device=self.index.device)]

    def unique_positions(self, keep: Sequence[bool]) -> list[int]:
        """Return the positions within :meth:`subset` of each parameter's first listing.

        Args:
            keep: whether each listed parameter is kept; it must treat every listing of a parameter
                alike.

        Returns:
            The positions.
        """
        first = self.first or (True,) * len(self.params)
        picked = [f for f, k in zip(first, keep, strict=True) if k]
        return [i for i, f in enumerate(picked) if f]

    @staticmethod
    def grads(params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
        """Return each parameter's gradient as the reads take it.

        A sparse gradient is taken as its coalesced values, ``None`` as one zero; under FSDP2, this
        rank's shard.

        Args:
            params: the parameters.

        Returns:
            The gradients, in parameter order.
        """
        plain = plain_grads(params)
        if plain is not None:
            return plain
        out = []
        for p in params:
            g = p.grad
            if g is None:
                g = to_local(p).new_zeros(1)
            elif g.is_sparse:
                g = g.coalesce().values()
                g = g if g.numel() else p.new_zeros(1)
            out.append(to_local(g))
        return out


@dataclass(frozen=True)
class LayerIndex:
    """How per-parameter values add into layer rows, then a global row.

    The tensors are on the parameters' device, made once per set of parameters: views, never
    copies, of its buffers.

    Attributes:
        index: the layer row of each parameter (``long``).
        numel: ``[layers]`` number of parameter elements per layer (float).
        unique: positions of each parameter's first listing, which the global row counts (a
            shared parameter once); ``None``: every listing.
        total_numel: the elements of the global row (``None``: the sum of ``numel``).
    """

    index: torch.Tensor
    numel: torch.Tensor
    unique: torch.Tensor | None = None
    total_numel: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        """The layer rows, before the global one."""
        return self.numel.numel()


def _total(values: torch.Tensor, unique: torch.Tensor | None) -> torch.Tensor:
    """Return the sum of ``values`` over the ``unique`` positions (``None``: all), as ``[1]``."""
    return (values if unique is None else values.index_select(0, unique)).sum().view(1)


def segment_norm(
    norms: torch.Tensor, index: torch.Tensor, num_layers: int, unique: torch.Tensor | None = None
) -> torch.Tensor:
    """Return the L2 norms of per-layer groups of per-parameter L2 ``norms``.

    Args:
        norms: the L2 norm of each parameter.
        index: the layer row of each parameter.
        num_layers: the layer rows.
        unique: the positions the last row counts (a shared parameter once; ``None``: all).

    Returns:
        ``[layers + 1]`` norms; the last is over all (the ``unique`` listings).
    """
    squares = norms.square()
    sq = norms.new_zeros(num_layers).index_add_(0, index, squares)
    return torch.cat([sq, _total(squares, unique)]).sqrt()


def segment_max(values: torch.Tensor, index: torch.Tensor, num_layers: int) -> torch.Tensor:
    """Return the per-layer maxima of ``values`` (NaN propagates).

    Args:
        values: one value per parameter.
        index: the layer row of each parameter.
        num_layers: the layer rows.

    Returns:
        ``[layers + 1]`` maxima; the last is over all.
    """
    peak = values.new_zeros(num_layers).scatter_reduce(0, index, values, "amax", include_self=False)
    return torch.cat([peak, values.max().view(1)])


def param_norms(
    tensors: Sequence[torch.Tensor], workspace: Workspace | None = None
) -> torch.Tensor:
    """Read the L2 norm of each tensor in one multi-tensor pass (on the CPU in stacks).

    Args:
        tensors: the tensors whose norms are read.
        workspace: the reader's workspace, which keeps the CPU's stacks from one step to the
            next (``None``: no stack, the same numbers).

    Returns:
        ``[len(tensors)]`` float32 norms.
    """
    grouping = cpu_grouping(tensors, workspace)
    if grouping is not None:
        return grouping(tensors).float()
    return torch.stack(foreach_norm(list(tensors), 2.0)).float()


@torch.no_grad()
def grad_stats(
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor] | None,
    layers: LayerIndex,
    *,
    shards: ShardPlan | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Return the statistics of one optimizer step's gradients, per layer and over all.

    Rows: the layers of ``layers.numel``, then all of them (with ``layers.unique``, the first
    listings: a shared parameter once, its mean over ``layers.total_numel``). Columns:
    :data:`GRAD_STATS`, the non-finite one 1 or 0. ``params=None``: the weight column is NaN.

    Args:
        grads: the gradients, one per parameter listing.
        params: the parameters, for the weight column (``None``: NaN).
        layers: how each parameter adds into its layer row and the global row.
        shards: the plan that makes shard-local figures whole in one collective (``None``: the
            parameters are not sharded).
        workspace: the reader's workspace, which keeps the CPU's stacks from one step to the next.

    Returns:
        ``[layers + 1, len(GRAD_STATS)]`` statistics.

    Example:
        >>> g = [torch.tensor([3.0, -4.0]), torch.tensor([1.0])]
        >>> w = [torch.ones(2), torch.ones(1)]
        >>> grad_stats(g, w, LayerIndex(torch.tensor([0, 1]), torch.tensor([2.0, 1.0])))
        tensor([[5.0000, 3.5000, 4.0000, 0.0000, 1.4142],
                [1.0000, 1.0000, 1.0000, 0.0000, 1.0000],
                [5.0990, 2.6667, 4.0000, 0.0000, 1.7321]])
    """
    index = layers.index
    unique = layers.unique
    num_layers = layers.num_layers
    l2 = param_norms(grads, workspace)
    sums, peak = abs_sum_max(grads, workspace)
    weight = torch.full_like(l2, torch.nan) if params is None else param_norms(params, workspace)
    if shards is not None:  # shard-local partials made whole: one collective
        whole = shards.reduce(norms=[l2, weight], sums=[sums], maxima=[peak])
        l2, weight = whole.norms
        (sums,) = whole.sums
        (peak,) = whole.maxima
    peak = peak.float()
    sums = sums.float()
    l1 = torch.cat([sums.new_zeros(num_layers).index_add_(0, index, sums), _total(sums, unique)])
    nonfinite = (~torch.isfinite(peak)).float()
    numel = layers.numel
    total_numel = layers.total_numel
    total = numel.sum().view(1) if total_numel is None else total_numel.view(1)
    return torch.stack(
        [
            segment_norm(l2, index, num_layers, unique),
            l1 / torch.cat([numel, total]),
            segment_max(peak, index, num_layers),
            segment_max(nonfinite, index, num_layers),
            segment_norm(weight, index, num_layers, unique),
        ],
        dim=1,
    )


@torch.no_grad()
def update_norms(
    before: Sequence[torch.Tensor],
    after: Sequence[torch.Tensor],
    layers: LayerIndex,
    *,
    shards: ShardPlan | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Return the norms of ``after - before`` per layer and over all.

    Args:
        before: the parameters before the step; overwritten.
        after: the parameters after the step.
        layers: how each parameter adds into its layer row and the global row (with
            ``layers.unique``, a shared parameter once).
        shards: the plan that makes shard-local figures whole in one collective (``None``: the
            parameters are not sharded).
        workspace: the reader's workspace, which keeps the CPU's stacks.

    Returns:
        ``[layers + 1]`` norms; the last is over all.
    """
    diffs = list(before)
    internals.foreach_sub_(diffs, list(after))
    norms = param_norms(diffs, workspace)
    if shards is not None:  # shard-local norms made whole: one collective
        (norms,) = shards.reduce(norms=[norms]).norms
    return segment_norm(norms, layers.index, layers.num_layers, layers.unique)
