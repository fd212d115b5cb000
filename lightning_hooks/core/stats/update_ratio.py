"""The update-to-weight ratio of an optimizer step, per layer, on the device."""

from __future__ import annotations

import torch

from lightning_hooks.core.alarms import GradientAlarms
from lightning_hooks.core.kernels.grad_stats import update_norms as _update_norms
from lightning_hooks.core.kernels.updates import typical_update
from lightning_hooks.core.stats.accumulator import LayerStatsAccumulator
from lightning_hooks.core.stats.optimizer_view import OptimizerView, adaptive
from lightning_hooks.core.transport.sharding import ShardPlan, to_local

__all__ = ["UpdateRatio"]


class UpdateRatio:
    """``||w_after - w_before|| / ||w_before||`` per layer of an optimizer step, into one
    column of ``accumulator``: :meth:`keep` copies the weights before the step into the view's
    buffers, :meth:`record` (in the optimizer step's post-hook) reduces the update.

    Args:
        accumulator: where the ratios go.
        column: the accumulator's column of the ratios.
        shards: the FSDP2 plan that makes the shards' norms whole, or ``None``.
    """

    def __init__(
        self, accumulator: LayerStatsAccumulator, column: int, shards: ShardPlan | None
    ) -> None:
        self.accumulator, self.column, self.shards = accumulator, column, shards

    @staticmethod
    def keep(view: OptimizerView, weight_norm: torch.Tensor) -> None:
        """Copy the weights ``view`` steps, and their norms, before the step."""
        torch._foreach_copy_(view.before, [to_local(p) for p in view.params])
        view.weight_norm = weight_norm

    def record(
        self,
        optimizer: torch.optim.Optimizer,
        view: OptimizerView,
        alarms: GradientAlarms | None,
        step: int,
    ) -> None:
        """After ``optimizer``'s step: the ratio of each layer :meth:`keep` saw, and the
        typical update the alarms' *stall* reads (adaptive optimizers only)."""
        if view.weight_norm is None:
            return
        num_layers = len(view.rows) - 1
        after = [to_local(p) for p in view.params]
        if alarms is not None and adaptive(optimizer, view.params):
            # before update_norms, which overwrites view.before; a logging step only
            lr = max(float(g["lr"]) for g in optimizer.param_groups)
            applied: list[torch.Tensor | None] = [
                to_local(p.grad) if p.grad is not None else None for p in view.params
            ]
            typical = typical_update(view.before, after, applied)
            alarms.update_stall(typical, lr, step=step)
        upd = _update_norms(
            view.before, after, view.index, num_layers, unique=view.unique, shards=self.shards
        )
        ratio = upd / view.weight_norm.clamp_min(torch.finfo(upd.dtype).tiny)
        valid = (view.weight_norm > 0)[:, None]
        self.accumulator.update(ratio[:, None], [self.column], view.rows, valid, replicated=True)
        view.weight_norm = None
