"""The loss rules' reading in a multi-process run: the mean loss over the ranks, carried on one
``all_reduce`` per batch with the ranks' agreement (a deferred failure, a stop request)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn

from lightning_hooks.core.alarms import AlarmRules, GradientAlarm, GradientAlarms
from lightning_hooks.core.transport.distributed import (
    all_reduce_sum_,
    group_device,
    to_group_device,
    world_size,
)
from lightning_hooks.core.transport.readback import HostMailbox
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["LossAgreement", "LossReading"]

LossReading = Literal["own", "mean", "off"]
Act = Callable[[pl.Trainer, torch.optim.Optimizer | None, list[GradientAlarm]], None]


class LossAgreement:
    """Feeds the loss rules (*diverging*, *loss_spike*) ``training_step``'s loss and carries the
    ranks' agreement with it: :class:`~.alarm_policy.AlarmPolicy`'s loss part.

    Args:
        act: what to do with the alarms the loss rules raise (``AlarmPolicy.act``).
    """

    def __init__(self, act: Act) -> None:
        self._act = act
        self._carrier: HostMailbox | None = None
        self.reading: LossReading = "own"
        """What the loss rules read in this fit (:meth:`plan`)."""
        self._manual = False
        self._pending: tuple[torch.Tensor, int, list[tuple[Any, int]]] | None = None

    def plan(self, pl_module: pl.LightningModule, rules: AlarmRules | None) -> None:
        """Decide, at the start of a fit, what the loss rules read (:attr:`reading`).

        - ``"own"``: one process, or no loss rule on: the loss ``training_step`` returns;
        - ``"mean"``: a distributed run (world size > 1): the mean of the ranks' losses, as
          ``self.log(..., sync_dist=True)`` computes it, in one ``all_reduce`` per batch that
          every rank makes (:meth:`observe`), so that every rank takes the same decision at
          the same step. Under manual optimization ``training_step`` may return a loss on some
          ranks and nothing on others: the ``all_reduce`` counts the ranks with a loss, and the
          loss rules read the mean only when every rank returned one; the first batch where the
          ranks disagree turns the rules off on every rank (``"off"``, one warning).
        """
        self.reading = "own"
        self._carrier = None
        if rules is None or not rules.watches_loss or world_size() == 1:
            return
        self.reading = "mean"
        # A Fabric loop feeds its loss when it wants (fabric.py): read as manual optimization.
        fabric = getattr(pl_module, "_fabric", None) is not None
        self._manual = fabric or not getattr(pl_module, "automatic_optimization", False)
        self._carrier = HostMailbox((_CARRIED,), group_device())

    def observe(
        self,
        trainer: pl.Trainer,
        alarms: GradientAlarms,
        outputs: Any,
        step: int,
        *,
        failed: bool,
        stop: bool,
    ) -> list[int] | None:
        """The loss rules (*diverging*, *loss_spike*) on ``training_step``'s loss (a device
        tensor), when one is on; in a distributed run on the mean over ranks (:meth:`plan`).

        In a distributed run the loss's ``all_reduce`` also carries this rank's ``failed`` (a
        guard's deferred failure) and ``stop`` (a stop this rank read); their sums over the ranks
        come back from the host copy, read without blocking for a copy of this batch: at once on
        the CPU, at the next batch on CUDA. Returns ``[ranks failed, ranks stopping]`` once read,
        else ``None``: every rank reads it at the same batch, and before the loss rules run,
        which may raise.
        """
        if not alarms.rules.watches_loss or self.reading == "off":
            return None
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        loss = loss if isinstance(loss, torch.Tensor) else None
        if self.reading == "own":
            if loss is not None:
                alarms.update_loss(loss, step=step)
                self._act(trainer, None, alarms.poll())
            return None
        assert self._carrier is not None
        read = [self._carrier.read(wait=True)]  # CUDA: the last batch's, posted then
        carried = _carry(loss, failed, stop)
        self._carrier.post(carried, meta=step)
        if carried.device.type != "cuda":
            read.append(self._carrier.read(wait=True))
        sums = [(got[0].copy(), got[1]) for got in read if got is not None]
        self._pending = (carried, step, sums)
        disagree = [(at, int(v[1])) for v, at in sums if 0 < v[1] < world_size()]
        if self._manual and disagree:  # decided on the host, before anything that may raise
            self._rules_off(*disagree[0])
        return [int(sum(s[0][2] for s in sums)), int(sum(s[0][3] for s in sums))] if sums else None

    def apply(self, trainer: pl.Trainer, alarms: GradientAlarms) -> None:
        """The loss rules on the batch :meth:`observe` carried (a distributed run): the
        mean loss at once under automatic optimization; under manual optimization the mean once
        read, when every rank returned a loss, else the rules turn off on every rank."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        carried, step, sums = pending
        if not self._manual:
            alarms.update_loss(carried[0] / world_size(), step=step)
        elif self.reading == "mean":
            for values, at in sums:
                if values[1] == world_size():
                    alarms.update_loss(torch.tensor(float(values[0]) / world_size()), step=at)
        self._act(trainer, None, alarms.poll())

    def _rules_off(self, step: int, with_loss: int) -> None:
        self.reading = "off"
        self._carrier = None
        rank_zero_warn(
            "GradFlowCallback: the loss rules (diverging, loss_spike) are off from step "
            f"{step} on: under manual optimization {with_loss} of {world_size()} ranks' "
            "training_step returned a loss there, the others none, so the mean over ranks is "
            "unknown; the gradient rules still run. Return the loss on every rank to keep them, "
            "or pass alarms=AlarmRules(diverge_ratio=None) (without loss_factor) to turn them off "
            "without this warning.",
            category=LightningHooksWarning,
        )

    @property
    def carries(self) -> bool:
        """Whether every batch's loss ``all_reduce`` carries the ranks' agreement."""
        return self._carrier is not None


_CARRIED = 4  # the loss, whether this rank has one, a deferred failure, a stop request


def _carry(loss: torch.Tensor | None, failed: bool, stop: bool) -> torch.Tensor:
    """``[loss, has loss, failed, stop]`` summed over the ranks, on the group's device: the loss
    moved there without a sync (a CPU loss under NCCL), the flags copied from the host."""
    flags = [0.0, float(loss is not None), float(failed), float(stop)]
    carried = torch.tensor(flags, dtype=torch.float32).to(device=group_device(), non_blocking=True)
    if loss is not None:
        carried[:1].copy_(to_group_device(loss).reshape(1))
    return all_reduce_sum_(carried)
