"""The alarms of ``GradFlowCallback``: those of each fit, and their state across fits.

:class:`FitAlarms` belongs to one fit: it passes the alarms each step's gradient norms and each
batch's loss, acts on what they find, and logs them. :class:`AlarmsAcrossFits` lives as long as
the callback: it makes each fit's :class:`FitAlarms` from the state the last fit or a checkpoint
left, keeps that fit's state when it ends, and saves the running fit's in checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn

from lightning_hooks.callbacks.alarm_policy import OWNER, Action, AlarmPolicy
from lightning_hooks.callbacks.loss_agreement import LossAgreement
from lightning_hooks.callbacks.ranks import RankAgreement
from lightning_hooks.callbacks.trainer import TrainerView, gradient_clipping
from lightning_hooks.core import GradFlowTracker
from lightning_hooks.core.alarms import AlarmRules, RunFacts, TrainingAlarms
from lightning_hooks.core.stats.alarm_feed import AlarmFeed, Measured
from lightning_hooks.core.stats.stability import Result as StabilityResult
from lightning_hooks.errors import LightningHooksWarning

__all__ = ["AlarmsAcrossFits", "FitAlarms"]


@dataclass
class FitAlarms:
    """Runs the alarms of one fit: feeds them, acts on what they find, and logs them.

    :meth:`AlarmsAcrossFits.start` makes it at the fit's train start and holds it as
    :attr:`AlarmsAcrossFits.running` until :meth:`AlarmsAcrossFits.end`, when the fit's module
    hooks are removed. The callback's Lightning hooks call it at each step.
    """

    trainer: TrainerView
    feed: AlarmFeed
    """Hands the alarms each step's gradient norms."""
    policy: AlarmPolicy
    """What the alarms do and how they are logged. Its warnings, stop and counts belong to this
    fit alone."""
    loss_agreement: LossAgreement
    """Hands the alarms each batch's loss, the mean over the ranks under DDP."""

    @property
    def training_alarms(self) -> TrainingAlarms:
        """Return the fit's ``TrainingAlarms``: the rules' running scales, ring buffer, counts."""
        return self.feed.training_alarms

    def check_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        measured: Measured | None,
        *,
        grad_scale: torch.Tensor | None,
        param_grad_scale: torch.Tensor | None,
    ) -> None:
        """Pass the alarms the gradients ``optimizer`` is about to apply, and act on them.

        Args:
            optimizer: the optimizer about to step.
            measured: what the tracker measured of this step, on a logging step; else ``None``.
            grad_scale: the AMP loss scale, or ``None``.
            param_grad_scale: the loss scale the parameter gradients still carry, or ``None``.
        """
        self.feed.observe(
            optimizer,
            measured,
            step=self.trainer.global_step,
            grad_scale=grad_scale,
            param_grad_scale=param_grad_scale,
            clip=gradient_clipping(self.trainer),
        )
        found = self.training_alarms.poll(wait=self.policy.wait)
        if found:
            self.policy.act(self.trainer, optimizer, self.training_alarms, found)

    def feed_loss(self, outputs: STEP_OUTPUT, step: int) -> None:
        """Pass the batch's loss to the loss rules at optimizer step ``step``, and act on them.

        Args:
            outputs: what the batch's ``training_step`` returned, which holds its loss.
            step: the optimizer step the batch feeds.
        """
        losses = self.loss_agreement.losses(self.trainer, outputs, step)
        if losses is None:
            return
        for loss in losses:
            self.training_alarms.update_loss(loss.value, step=loss.step)
        self.policy.act(self.trainer, None, self.training_alarms, self.training_alarms.poll())

    def log_step(self, step: int) -> None:
        """Log the alarm counts and text gathered since the last logging step, at ``step``.

        Args:
            step: the logging step.
        """
        self.policy.log.log_step(self.trainer, self.training_alarms, step)

    def watch_attention(self, step: int, result: StabilityResult) -> None:
        """Pass a logging step's attention logits and entropies to the attention rule.

        Args:
            step: the logging step.
            result: the step's instability statistics.
        """
        self.training_alarms.update_attention(
            result.attn_logit_max, result.attn_entropy_min, step=step
        )

    def start_log(self) -> None:
        """Start the fit's log from the counts the alarms hold now, which were already written."""
        self.policy.log.start(self.training_alarms)

    def end_epoch(self) -> None:
        """Act on the epoch's last results, then log its counts and text."""
        self.policy.end_epoch(self.trainer, self.training_alarms)

    def announce_stop(self) -> None:
        """Warn once, at the fit's end, if an alarm's stop ended it."""
        self.policy.announce_stop(self.trainer)


class AlarmsAcrossFits:
    """Starts each fit's alarms, and carries their state from one fit to the next.

    The state is :meth:`~lightning_hooks.core.alarms.TrainingAlarms.state_dict`: the running
    scales, the ring buffer of recent steps and the counts (see docs/glossary.md). Between fits
    it is what the last fit left or a checkpoint loaded; a new fit starts from it, and while a
    fit runs a checkpoint saves that fit's state. The fit's log treats loaded counts as already
    written, so it logs only what the alarms count after them.

    Args:
        rules: the alarm rules (``None``: no alarms; a checkpoint's state is still carried).
        actions: the action of each rule.

    Example:
        >>> from lightning_hooks.callbacks.alarm_policy import check_actions
        >>> alarms = AlarmsAcrossFits(AlarmRules(), check_actions("warn"))
        >>> alarms.host_state()  # no fit ran yet, and no checkpoint was loaded
        {}
    """

    def __init__(self, rules: AlarmRules | None, actions: Mapping[str, Action]) -> None:
        self.rules = rules
        self.actions = actions
        self._state: dict[str, Any] | None = None  # carried between fits
        self.running: FitAlarms | None = None
        """The running fit's alarms, from :meth:`start` to :meth:`end`; ``None`` between fits."""

    def start(
        self,
        trainer: TrainerView,
        pl_module: nn.Module,
        tracker: GradFlowTracker,
        ranks: RankAgreement,
    ) -> FitAlarms | None:
        """Start a fit's alarms on ``tracker``, from the state carried.

        Their messages quote the run's learning rate and output units. A state left for
        another model's layers is dropped with a warning, and the running scales start afresh.

        Args:
            trainer: the trainer of the fit.
            pl_module: the model, whose learning rate and output units the messages quote.
            tracker: the fit's tracker, which the alarms' feed reads.
            ranks: the fit's agreement across ranks, which stops or disables every rank alike.

        Returns:
            The fit's alarms, or ``None`` without rules.
        """
        if self.rules is None:
            return None
        feed = AlarmFeed(tracker, self.rules)
        feed.training_alarms.set_run_facts(RunFacts.of(pl_module, trainer.optimizers))
        running = FitAlarms(
            trainer=trainer,
            feed=feed,
            policy=AlarmPolicy(self.actions, request_stop=ranks.request_stop),
            loss_agreement=LossAgreement(ranks, pl_module, self.rules),
        )
        if self._state is not None:
            try:
                running.training_alarms.load_state_dict(self._state)
            except ValueError as err:
                self._state = None  # another model's state: drop it now, not at every later fit
                rank_zero_warn(
                    f"{OWNER}: {err}; running scales start afresh.",
                    category=LightningHooksWarning,
                )
        running.start_log()
        self.running = running
        return running

    def end(self) -> None:
        """Keep the ending fit's state for the next fit; warn if an alarm's stop ended the fit."""
        running = self.running
        self.running = None
        if running is None:
            return
        self._state = running.training_alarms.state_dict()
        running.announce_stop()

    def host_state(self) -> dict[str, Any]:
        """Return what a checkpoint saves: the running fit's state, else the one carried, or {}."""
        running = self.running
        if running is not None:
            return running.training_alarms.state_dict()
        return dict(self._state or {})

    def load_host_state(self, state: dict[str, Any]) -> None:
        """Continue from the alarm state a checkpoint saved.

        A running fit's alarms load it at once. A state they refuse raises, so that the
        callback drops the whole checkpoint with one warning; the state carried is unchanged.

        Args:
            state: what :meth:`host_state` returned. An empty dict means none.

        Raises:
            ValueError: the state was saved for another model's layers, or by an older version.
        """
        loaded = dict(state) or None
        running = self.running
        if running is not None and loaded is not None:
            running.training_alarms.load_state_dict(loaded)
        self._state = loaded
        if running is not None:
            running.start_log()
