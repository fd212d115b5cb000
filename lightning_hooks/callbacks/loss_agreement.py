"""Which loss the loss rules read at each batch: this rank's loss, or the mean over the ranks.

With several processes, one ``all_reduce`` of four numbers per batch carries the mean loss,
whether a hook failed on any rank, and whether any rank asked to stop, so a logging step needs
no collective of its own for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, NamedTuple

import numpy as np
import torch
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn

from lightning_hooks.callbacks.ranks import RankAgreement
from lightning_hooks.callbacks.trainer import TrainerView
from lightning_hooks.core.alarms import AlarmRules
from lightning_hooks.core.distributed import (
    all_reduce_sum_,
    group_device,
    to_group_device,
    world_size,
)
from lightning_hooks.core.host_copy import HostCopy
from lightning_hooks.errors import LightningHooksWarning
from lightning_hooks.internals.lightning import is_set_up_by_fabric

__all__ = ["Loss", "LossAgreement", "RankFlags", "training_loss"]


class RankFlags(NamedTuple):
    """How many ranks reported a failed hook, and how many asked to stop, by a batch's step."""

    failed: int
    stopping: int
    step: int
    """The optimizer step of the last batch whose sums carried them (on CUDA, the batch
    before the one that reads them)."""


class _Sums(NamedTuple):
    """One batch's collective as read on the host: four sums over the ranks, and the step."""

    loss: float
    with_loss: int  # ranks whose ``training_step`` returned a loss
    failed: int
    stopping: int
    step: int

    @classmethod
    def of(cls, values: np.ndarray, step: int) -> _Sums:
        """Return the collective's host copy as four named sums, with the step that posted it."""
        return cls(float(values[0]), int(values[1]), int(values[2]), int(values[3]), step)


class Loss(NamedTuple):
    """A loss for the loss rules, and the optimizer step it belongs to."""

    value: torch.Tensor
    step: int


class _Exchanged(NamedTuple):
    """One batch's exchange, which :meth:`LossAgreement._mean_losses` turns into losses."""

    device_sums: torch.Tensor
    """This batch's sums over the ranks, left on the device unread."""
    step: int
    """The optimizer step the batch feeds."""
    host_sums: list[_Sums]
    """The sums that have reached the host: on CUDA the previous batch's, else this one's."""

    def flags(self) -> RankFlags | None:
        """Return the ranks' summed flags of the sums on the host; ``None`` before any arrived."""
        if not self.host_sums:
            return None
        failed = sum(sums.failed for sums in self.host_sums)
        stopping = sum(sums.stopping for sums in self.host_sums)
        return RankFlags(failed, stopping, step=self.host_sums[-1].step)

    def partial(self) -> _Sums | None:
        """Return the first sums on the host where some ranks returned a loss and others none."""
        for sums in self.host_sums:
            if 0 < sums.with_loss < world_size():
                return sums
        return None


class LossAgreement:
    """Reads the loss from ``training_step`` for the loss rules, with the ranks' flags alongside.

    Each fit makes its own. With one process, the rules read its loss; with several, the mean
    over the ranks, from one ``all_reduce`` per batch that also carries each rank's failure flag
    and stop request to ``ranks``.

    Args:
        ranks: the callback's agreement across ranks, which acts on the failures and stops.
        pl_module: the model. Whether Fabric set it up and whether it uses automatic
            optimization decide how a batch's loss is read.
        rules: the fit's alarm rules (``None``: no alarms, so no loss is read).
        owner: the callback's name, which begins its messages.

    Example:
        >>> from lightning_hooks.core.hooks.guard import Guard
        >>> guard = Guard("Cb", strict=False)
        >>> ranks = RankAgreement(guard, remove_hooks=lambda: None)
        >>> agreement = LossAgreement(ranks, torch.nn.Linear(1, 1), AlarmRules(), "Cb")
        >>> agreement.reading  # one process: this rank's own loss, no collective
        'own'
    """

    def __init__(
        self,
        ranks: RankAgreement,
        pl_module: nn.Module,
        rules: AlarmRules | None,
        owner: str,
    ) -> None:
        self._ranks = ranks
        self.owner = owner
        self._sums_to_host: HostCopy | None = None
        self._manual = False
        self._warned_of_shape = False  # a loss that is not one number is refused once a fit
        self.reading: Literal["own", "mean", "off"] = "off"
        """How this fit reads the loss: ``"off"`` (no loss rule), ``"own"`` (one process) or
        ``"mean"``. Under manual optimization it turns ``"off"`` at the first batch where some
        ranks return a loss and others do not."""
        if rules is None or not rules.watches_loss:
            return
        if world_size() == 1:
            self.reading = "own"
            return
        self.reading = "mean"
        # A Fabric loop hands over its loss whenever it chooses (see fabric_run.py), so it is
        # treated like manual optimization.
        fabric = is_set_up_by_fabric(pl_module)
        self._manual = fabric or not getattr(pl_module, "automatic_optimization", False)
        self._sums_to_host = HostCopy((4,), group_device())

    def losses(self, trainer: TrainerView, outputs: STEP_OUTPUT, step: int) -> list[Loss] | None:
        """Read one batch's loss for the loss rules at ``step``.

        Under ``"mean"``, the ranks' failures and stop requests are applied to ``trainer`` too.

        Args:
            trainer: the trainer of the batch, stopped where a rank asked to.
            outputs: what the batch's ``training_step`` returned, which holds its loss.
            step: the optimizer step the batch feeds.

        Returns:
            The losses the rules take now, each with its step, after which the alarms are
            polled (under ``"mean"`` on CUDA, the ranks' mean arrives a batch later, and a
            batch where some ranks returned no loss adds none); ``None`` where nothing was read:
            no loss, the rules off, or the callback disabled on every rank.
        """
        if self.reading == "own":
            loss = self._one_number(training_loss(trainer, outputs))
            return None if loss is None else [Loss(loss, step)]
        if self.reading == "mean":
            ranks = self._ranks
            loss = self._one_number(training_loss(trainer, outputs))
            exchanged = self._exchange(
                loss, step, failed=ranks.failed_here, stop=ranks.stop_requested
            )
            partial = exchanged.partial()
            if self._manual and partial is not None:  # decided before anything that may raise
                self._rules_off(partial.step, partial.with_loss)
            flags = exchanged.flags()
            if flags is not None:
                # The step the flags were sent at: on CUDA the batch before, so the ranks have
                # not agreed on this batch yet, and its logging step makes its own agreement.
                disabled = ranks.apply(
                    trainer, flags.step, failed=flags.failed, stopping=flags.stopping
                )
                if disabled:  # the module hooks are removed on every rank, so skip the loss
                    return None
            return self._mean_losses(exchanged)
        return None

    def _one_number(self, loss: torch.Tensor | None) -> torch.Tensor | None:
        """Return ``loss`` if it is one number, else ``None``, with one warning in the fit.

        Under manual optimization ``training_step`` may return any tensor, a per-sample loss,
        say; the loss rules would read one element of it as the batch's loss.
        """
        if loss is None or loss.numel() == 1:
            return loss
        if not self._warned_of_shape:
            self._warned_of_shape = True
            rank_zero_warn(
                f"{self.owner}: training_step returned a loss of shape {tuple(loss.shape)}, not "
                "one number; the loss rules (diverging, loss_spike) read no loss from such a "
                "batch. Return the loss the optimizer minimizes (its mean, say) to have them.",
                category=LightningHooksWarning,
            )
        return None

    def _exchange(
        self, loss: torch.Tensor | None, step: int, *, failed: bool, stop: bool
    ) -> _Exchanged:
        """Sum the loss and the two flags over the ranks in the batch's ``all_reduce``.

        Returns:
            The batch's sums on the device, and those read on the host (on CUDA, one batch
            later).
        """
        sums_to_host = self._sums_to_host
        assert sums_to_host is not None  # made with the "mean" reading, the one that exchanges
        read = _read_sums(sums_to_host)  # on CUDA, the previous batch's collective
        device_sums = _all_reduce_loss_and_flags(loss, failed, stop)
        sums_to_host.post(device_sums, meta=step)
        if device_sums.device.type != "cuda":
            read += _read_sums(sums_to_host)  # off CUDA it has finished, so read this batch's
        return _Exchanged(device_sums, step, read)

    def _mean_losses(self, exchanged: _Exchanged) -> list[Loss]:
        """Return the ranks' mean loss of the batches read, for the loss rules.

        Under manual optimization, a batch's mean is used only if every rank returned a loss.

        Args:
            exchanged: the batch's exchange.

        Returns:
            The means, each with its step.
        """
        if not self._manual:
            # Automatic optimization: every rank returned a loss, so this batch's mean is
            # taken from its sum on the device, with no host sync.
            return [Loss(exchanged.device_sums[0] / world_size(), exchanged.step)]
        if self.reading != "mean":
            return []
        # Manual optimization (or Fabric): only the batches whose sums have reached the host
        # (on CUDA a batch late), and only where every rank returned a loss.
        everyone = [sums for sums in exchanged.host_sums if sums.with_loss == world_size()]
        return [Loss(torch.tensor(sums.loss / world_size()), sums.step) for sums in everyone]

    def _rules_off(self, step: int, with_loss: int) -> None:
        """Turn the loss rules off for the rest of the fit, with one warning."""
        self.reading = "off"
        rank_zero_warn(
            f"{self.owner}: the loss rules (diverging, loss_spike) are off from step "
            f"{step} on: under manual optimization {with_loss} of {world_size()} ranks' "
            "training_step returned a loss there, the others none, so the mean over ranks is "
            "unknown; the gradient rules still run. Return the loss on every rank to keep them, "
            "or pass alarms=AlarmRules(diverge_ratio=None) (without loss_factor) to turn them off "
            "without this warning.",
            category=LightningHooksWarning,
        )


def _read_sums(sums_to_host: HostCopy) -> list[_Sums]:
    """Read the last collective posted to ``sums_to_host``, waiting; empty if none since."""
    got = sums_to_host.read(wait=True)
    if got is None:
        return []
    values, step = got
    return [_Sums.of(values, step)]


def _all_reduce_loss_and_flags(loss: torch.Tensor | None, failed: bool, stop: bool) -> torch.Tensor:
    """Sum this rank's loss and flags over the ranks, in one ``all_reduce``.

    Returns:
        ``[loss, ranks with a loss, ranks failed, ranks stopping]``, on the group's device (the
        loss is moved there without a host sync).
    """
    flags = [0.0, float(loss is not None), float(failed), float(stop)]
    sums = torch.tensor(flags, dtype=torch.float32).to(device=group_device(), non_blocking=True)
    if loss is not None:
        sums[:1].copy_(to_group_device(loss).reshape(1))
    return all_reduce_sum_(sums)


def training_loss(trainer: TrainerView, outputs: STEP_OUTPUT) -> torch.Tensor | None:
    """Read ``training_step``'s loss in the user's units.

    Under automatic optimization, Lightning passes the batch-end hooks the loss divided by
    ``accumulate_grad_batches``. The alarms quote losses as the user logs them, so this function
    undoes the division.

    Args:
        trainer: the trainer, whose ``accumulate_grad_batches`` and optimization mode decide.
        outputs: what ``training_step`` returned, as the batch-end hook gets it.

    Returns:
        The loss, detached where it is scaled back, or ``None`` where ``training_step``
        returned no tensor loss.
    """
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if not isinstance(loss, torch.Tensor):
        return None
    accumulate = trainer.accumulate_grad_batches
    module = trainer.lightning_module
    if accumulate > 1 and getattr(module, "automatic_optimization", False):
        return loss.detach() * accumulate
    return loss
