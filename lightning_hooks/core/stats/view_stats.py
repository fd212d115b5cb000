"""The gradient statistics of the parameters one optimizer steps, per layer, on the device."""

from __future__ import annotations

import torch

from lightning_hooks.core.kernels.grad_stats import (
    GRAD_STATS,
    ParamLayout,
    grad_stats,
    param_norms,
    segment_norm,
)
from lightning_hooks.core.kernels.tensors import Workspace
from lightning_hooks.core.stats.optimizer_view import OptimizerView
from lightning_hooks.core.transport.sharding import ShardPlan, to_local

__all__ = ["ViewStats"]

_WEIGHT = GRAD_STATS.index("weight_norm")
_GRAD = slice(0, _WEIGHT)  # the gradient's columns of GRAD_STATS


class ViewStats:
    """``[rows, GRAD_STATS]`` of an :class:`OptimizerView`: every column, or only the norms
    the alarms need; shards made whole under FSDP2 (``shards``), in one collective.

    Args:
        shards: the FSDP2 plan of the tracked parameters, or ``None``.
        workspace: the ``|g|`` pass's buffer, reused every step.
    """

    def __init__(self, shards: ShardPlan | None, workspace: Workspace) -> None:
        self.shards, self.workspace = shards, workspace

    def full(
        self, view: OptimizerView, grads: list[torch.Tensor], *, weights: bool = True
    ) -> torch.Tensor:
        """:func:`grad_stats` of ``view`` (``weights``: also the weight norms)."""
        params = [to_local(p) for p in view.params] if weights else None
        numel, total = view.numel[:-1], view.numel[-1]
        return grad_stats(
            grads,
            params,
            view.index,
            numel,
            unique=view.unique,
            total_numel=total,
            shards=self.shards,
            workspace=self.workspace,
        )

    def norms(
        self, view: OptimizerView, grads: list[torch.Tensor], *, weights: bool
    ) -> torch.Tensor:
        """The sentinel's columns, the others NaN: the gradient L2 norm (one multi-tensor pass)
        and with ``weights`` the weight norm."""
        norms = [param_norms(grads)]
        if weights:
            norms.append(param_norms([to_local(p) for p in view.params]))
        if self.shards is not None:
            norms = self.shards.reduce(norms=norms)[0]
        num_layers = len(view.rows) - 1
        stats = norms[0].new_full((num_layers + 1, len(GRAD_STATS)), torch.nan)
        unique = None if view.distinct else view.unique  # the same sum, one gather fewer
        for column, values in zip((0, _WEIGHT), norms, strict=False):
            stats[:, column] = segment_norm(values, view.index, num_layers, unique)
        return stats

    def weight_norms(self, view: OptimizerView) -> torch.Tensor:
        """``[rows]`` weight norms of ``view``: the alarms' attribution pass."""
        norms = param_norms([to_local(p) for p in view.params])
        if self.shards is not None:
            norms = self.shards.reduce(norms=[norms])[0][0]
        return segment_norm(norms, view.index, len(view.rows) - 1, view.unique)

    def applied(self, view: OptimizerView) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gradient columns of what the optimizer applied (read in its step post-hook,
        after clipping), and where they are valid (``None``: everywhere)."""
        valid = view.valid()
        grads = ParamLayout.grads(view.params)
        stats = self.full(view, grads, weights=False)[:, _GRAD]
        return stats, None if valid is None else valid[:, _GRAD]
