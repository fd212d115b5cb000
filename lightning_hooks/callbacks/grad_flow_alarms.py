"""The alarms of ``GradFlowCallback``: those of each fit, and their state across fits.

:class:`FitAlarms` belongs to one fit: it passes the alarms each step's gradient norms and each
batch's loss, acts on what they find, and logs them. :class:`AlarmsAcrossFits` lives as long as
the callback: it makes each fit's :class:`FitAlarms` from the state the last fit or a checkpoint
left, keeps that fit's state when it ends, and saves the running fit's in checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, NoReturn

import torch
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.utilities.types import STEP_OUTPUT
from torch import nn

from lightning_hooks.callbacks.alarm_actions import Action
from lightning_hooks.callbacks.alarm_log import AlarmLog, Written
from lightning_hooks.callbacks.loss_agreement import LossAgreement
from lightning_hooks.callbacks.ranks import RankAgreement
from lightning_hooks.callbacks.trainer import TrainerView, gradient_clipping
from lightning_hooks.core import GradFlowTracker
from lightning_hooks.core.alarms import AlarmRules, RunFacts, TrainingAlarm, TrainingAlarms
from lightning_hooks.core.hooks.registry import wrap_step_closure
from lightning_hooks.core.stats.alarm_feed import AlarmFeed, Measured
from lightning_hooks.core.stats.stability import Result as StabilityResult
from lightning_hooks.errors import LightningHooksWarning, TrainingAlarmError, TrainingAlarmWarning
from lightning_hooks.logging import save_loggers

__all__ = ["AlarmsAcrossFits", "FitAlarms", "SkippedSteps"]

_WRITTEN = "written"
"""The key of what a running fit's log had written of its epoch, by its last logging step."""


class FitAlarms:
    """Runs the alarms of one fit: feeds them, acts on what they find, and logs them.

    :meth:`AlarmsAcrossFits.start` makes it at the fit's train start and holds it as
    :attr:`AlarmsAcrossFits.running` until :meth:`AlarmsAcrossFits.end`, when the fit's module
    hooks are removed. The callback's Lightning hooks call it at each step.

    What it does with an alarm is the action of its rule, as :func:`.check_actions` reads
    ``on_alarm``: warn, stop the fit, raise, skip the optimizer step, or only log. A warning is
    given once per rule and layer in each epoch. Under DDP, ``stop`` and ``raise`` act on every
    rank. Each fit has its own, so the warnings, the stop and the counts belong to that fit alone.

    Args:
        trainer: the trainer of the fit.
        feed: hands the alarms each step's gradient norms.
        loss_agreement: hands the alarms each batch's loss, the mean over the ranks under DDP.
        actions: the action of every rule.
        request_stop: called with the trainer for a ``stop``: it stops the fit at once in one
            process; under DDP, once the ranks agree on it.
        owner: the callback's name, which begins each alarm's message.
    """

    def __init__(  # noqa: PLR0913 (the fit's parts, each built by AlarmsAcrossFits.start)
        self,
        trainer: TrainerView,
        feed: AlarmFeed,
        loss_agreement: LossAgreement,
        actions: Mapping[str, Action],
        request_stop: Callable[[TrainerView], None],
        owner: str,
    ) -> None:
        self.trainer = trainer
        self.owner = owner
        self.feed = feed
        self.loss_agreement = loss_agreement
        self.actions = dict(actions)
        self.log = AlarmLog(self.actions)
        """Writes the alarms to the loggers at each logging step and at each epoch end."""
        # ``skip`` must know the step's verdict before the optimizer step runs, and that costs a
        # CUDA sync.
        self.waits_for_verdict = "skip" in self.actions.values()
        self._request_stop = request_stop
        self._warned: set[tuple[str, str]] = set()
        self.stopped_by: TrainingAlarm | None = None
        """The first alarm whose ``stop`` acted in this fit."""
        self.skipped_steps = SkippedSteps(trainer)
        """The optimizer steps a ``skip`` marked, which it skips when they run."""

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
        found = self.training_alarms.poll(wait=self.waits_for_verdict)
        if found:
            self.act(optimizer, found)

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
        self.act(None, self.training_alarms.poll())

    def watch_attention(self, trainer: TrainerView, step: int, result: StabilityResult) -> None:
        """Pass a logging step's attention logits and entropies to the attention rule.

        The instability statistics' ``Logged`` calls it once the step's values are on the host.

        Args:
            trainer: the fit's trainer (this fit's own: :attr:`trainer`).
            step: the logging step.
            result: the step's instability statistics.
        """
        self.training_alarms.update_attention(
            result.attn_logit_max, result.attn_entropy_min, step=step
        )

    def act(self, optimizer: torch.optim.Optimizer | None, found: list[TrainingAlarm]) -> None:
        """Warn, stop, raise or skip for each alarm found, as its rule's action says.

        A ``skip`` applies only to an alarm of the trainer's current step, and drops the
        gradients of ``optimizer``. Before a ``raise``, the alarms since the last logging step
        are written.

        Args:
            optimizer: the optimizer about to step, whose step ``skip`` skips; ``None`` outside
                an optimizer step (a batch's end, for the loss rules, and an epoch's end).
            found: the alarms the rules found since the last poll.

        Raises:
            TrainingAlarmError: an alarm's rule has the action ``"raise"``.
        """
        stop = False
        to_warn = []
        for alarm in found:
            action = self.actions.get(alarm.rule)
            if action is None or action == "log":
                continue
            if action == "raise":
                self._raise(alarm)  # it does not return
            to_warn.append(alarm)
            if action == "stop":
                stop = True
                if self.stopped_by is None:
                    self.stopped_by = alarm
            elif (
                action == "skip"
                and optimizer is not None
                and alarm.step == self.trainer.global_step
            ):
                self.skipped_steps.mark(optimizer, alarm.step)
        if stop:
            self._request_stop(self.trainer)
        # Last: where the user's warning filter turns a warning into an error, the stop and the
        # skip are taken, and the error goes on to the user (see the guard).
        for alarm in to_warn:
            self._warn_once(alarm)

    def log_step(self, step: int) -> None:
        """Log the alarm counts and text gathered since the last logging step, at ``step``.

        Args:
            step: the logging step.
        """
        self.log.log_step(self.trainer, self.training_alarms, step)

    def start_log(self, written: Written | None = None) -> None:
        """Start the fit's log from what is already written.

        Args:
            written: what a checkpoint's fit had written; ``None``: everything the alarms hold
                now.
        """
        self.log.start(self.training_alarms, written)

    def state(self) -> dict[str, Any]:
        """Return what a checkpoint of this fit saves of its alarms.

        That is the rules' state (running scales, ring buffer, counts) and what the log had
        written of the counts by the last logging step. The epoch they are of is the
        checkpoint's own (:data:`~.checkpoint.EPOCH`, saved with the statistics).
        """
        written = self.log.written
        return {
            **self.training_alarms.state_dict(),
            _WRITTEN: {"counts": written.counts, "alarms": written.alarms},
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from what :meth:`state` saved (or release 0.2.0's rules' state alone).

        Args:
            state: the saved state.

        Raises:
            ValueError: the state was saved for another model's layers, before release 0.2.0,
                or in a format of a later release.
        """
        self.training_alarms.load_state_dict(state)
        written = None
        if _WRITTEN in state:
            written = Written(dict(state[_WRITTEN]["counts"]), int(state[_WRITTEN]["alarms"]))
        self.start_log(written)

    def start_new_epoch(self) -> None:
        """Drop the counts of the epoch a checkpoint was saved in: the fit resumes at the next."""
        self.training_alarms.take_epoch()
        self.start_log()

    def end_epoch(self) -> None:
        """Act on the epoch's last verdicts, then write its alarms and start the next epoch.

        Raises:
            TrainingAlarmError: a last verdict's rule has the action ``"raise"``.
        """
        self.act(None, self.training_alarms.poll(wait=True))
        self._warned.clear()  # in the next epoch, each rule and layer may warn once
        self.log.end_epoch(self.trainer, self.training_alarms)

    def announce_stop(self) -> None:
        """Warn once, at the fit's end, if an alarm's ``stop`` ended it.

        Without this warning, a fit that an alarm stopped looks like one that finished, except
        for its step count.
        """
        alarm = self.stopped_by
        self.stopped_by = None
        if alarm is not None and self.trainer.should_stop:
            rank_zero_warn(
                f"{self.owner} [{alarm.rule}]: on_alarm='stop' ended the fit at optimizer "
                f"step {self.trainer.global_step}, after the {alarm.rule} alarm of step "
                f"{alarm.step}:\n{alarm.message}",
                category=TrainingAlarmWarning,
            )

    def _raise(self, alarm: TrainingAlarm) -> NoReturn:
        """Write the alarms to the event files, then raise ``alarm`` as a ``TrainingAlarmError``.

        Raises:
            TrainingAlarmError: always. If a logger fails to write, that failure becomes the
                error's cause instead of hiding it.
        """
        error = TrainingAlarmError(
            _with_callback_name(self.owner, alarm),
            rule=alarm.rule,
            layer=alarm.layer,
            step=alarm.step,
            value=alarm.value,
            alarm=alarm,
        )
        try:
            self._keep_before_raising(alarm.step)
        except Exception as failure:
            raise error from failure
        raise error

    def _keep_before_raising(self, step: int) -> None:
        """Write the alarms since the last logging step at ``step``, and save the loggers.

        The raising alarm is included, so ``lightning-hooks report --fail-on`` can find the alarm
        that ended the fit.
        """
        self.log_step(step)
        save_loggers(self.trainer.loggers)

    def _warn_once(self, alarm: TrainingAlarm) -> None:
        """Warn of an alarm, attached as ``warning.alarm``, once per rule and layer in an epoch."""
        key = (alarm.rule, alarm.layer)
        if key not in self._warned:
            self._warned.add(key)
            warning = TrainingAlarmWarning(_with_callback_name(self.owner, alarm))
            warning.alarm = alarm
            rank_zero_warn(warning, category=TrainingAlarmWarning)


class SkippedSteps:
    """Skips the optimizer steps that an alarm's ``skip`` marks, when they run.

    :meth:`hook` is each optimizer's step pre-hook while some rule's action is ``skip``.

    Args:
        trainer: the trainer of the fit, whose ``global_step`` is the step running.
    """

    def __init__(self, trainer: TrainerView) -> None:
        self.trainer = trainer
        self._marked: dict[torch.optim.Optimizer, int] = {}

    def mark(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Mark ``optimizer``'s step ``step`` to be skipped.

        Args:
            optimizer: the optimizer whose step is skipped.
            step: the optimizer step, the one running.
        """
        self._marked[optimizer] = step

    def hook(
        self,
        optimizer: torch.optim.Optimizer,
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> tuple[tuple[object, ...], dict[str, object]] | None:
        """Skip ``optimizer``'s step if it is marked: its step pre-hook, under ``skip``.

        A skipped step's gradients are dropped after Lightning has clipped them, which by value
        refuses a model with no gradient at all; torch optimizers skip a parameter whose
        gradient is ``None``. Lightning runs the callbacks' ``on_before_optimizer_step`` and
        the clipping inside the closure it passes to ``step()``, so the gradients are dropped
        when that closure returns. A step without a closure (a GradScaler's, a Fabric loop's)
        was marked before it began: they are dropped now. A mark of a step that did not run (a
        GradScaler skipped it) is dropped at the next step, which runs.

        Args:
            optimizer: the optimizer about to step.
            args: the positional arguments of its ``step()``, the optimizer first (torch passes
                the bound method's ``self``), then the closure if given by position.
            kwargs: the keyword arguments of its ``step()``.

        Returns:
            The arguments with the closure wrapped, or ``None`` (unchanged) without a closure.
        """

        def skipping(closure: Callable[[], object]) -> Callable[[], object]:
            return partial(self._skip_after, optimizer, closure)

        wrapped = wrap_step_closure(args, kwargs, skipping)
        if wrapped is None:
            self._drop_marked_gradients(optimizer)
        return wrapped

    def _skip_after(
        self, optimizer: torch.optim.Optimizer, closure: Callable[[], object]
    ) -> object:
        """Run the step's closure, then drop the gradients if the step is marked to skip."""
        loss = closure()
        self._drop_marked_gradients(optimizer)
        return loss

    def _drop_marked_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Drop ``optimizer``'s gradients if its current step is marked to skip; unmark it."""
        if self._marked.pop(optimizer, None) != self.trainer.global_step:
            return
        for group in optimizer.param_groups:
            for param in group["params"]:
                param.grad = None


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
        owner: the callback's name, which begins the alarms' messages.

    Example:
        >>> from lightning_hooks.callbacks.alarm_actions import check_actions
        >>> alarms = AlarmsAcrossFits(AlarmRules(), check_actions("warn", "Cb"), "Cb")
        >>> alarms.host_state()  # no fit ran yet, and no checkpoint was loaded
        {}
    """

    def __init__(
        self,
        rules: AlarmRules | None,
        actions: Mapping[str, Action],
        owner: str,
    ) -> None:
        self.rules = rules
        self.actions = actions
        self.owner = owner
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
            loss_agreement=LossAgreement(ranks, pl_module, self.rules, self.owner),
            actions=self.actions,
            request_stop=ranks.request_stop,
            owner=self.owner,
        )
        if "skip" in self.actions.values():  # on the tracker's registry: removed with its hooks
            for optimizer in trainer.optimizers:
                tracker.registry.optimizer_step_pre_hook(optimizer, running.skipped_steps.hook)
        if self._state is not None:
            try:
                running.training_alarms.load_state_dict(self._state)
                # The counts and alarms of an epoch the last fit did not end (it failed part
                # way) are dropped, as its statistics are: this fit counts its own from 0.
                running.training_alarms.take_epoch()
            except ValueError as err:
                self._state = None  # another model's state: drop it now, not at every later fit
                rank_zero_warn(
                    f"{self.owner}: {err}; running scales start afresh.",
                    category=LightningHooksWarning,
                )
        running.start_log()
        self.running = running
        return running

    def end(self) -> None:
        """Keep the ending fit's state; warn if an alarm's stop ended the fit.

        The state kept is what a checkpoint of the running fit saves: a checkpoint saved after
        a failure (Lightning's ``OnExceptionCheckpoint``) continues the failed epoch. The next
        fit starts from its running scales.
        """
        running = self.running
        if running is None:
            return
        self._state = self.host_state()
        self.running = None
        running.announce_stop()

    def host_state(self) -> dict[str, Any]:
        """Return what a checkpoint saves: the running fit's state, else the one carried, or {}.

        The running fit's state also names its epoch, whose counts it holds, and the counts its
        log has written by the last logging step.
        """
        running = self.running
        if running is not None:
            return running.state()
        return dict(self._state or {})

    def start_new_epoch(self) -> None:
        """Drop the restored epoch's counts: the fit resumes at the next epoch.

        The lifecycle calls it (through the checkpoint slot) at the fit's first batch.
        """
        running = self.running
        if running is not None:
            running.start_new_epoch()

    def load_host_state(self, state: dict[str, Any]) -> None:
        """Continue from the alarm state a checkpoint saved.

        A running fit's alarms load it at once. A state they refuse raises, so that the
        callback drops the whole checkpoint with one warning; the state carried is unchanged.

        Args:
            state: what :meth:`host_state` returned. An empty dict means none.

        Raises:
            ValueError: the state was saved for another model's layers, before release 0.2.0,
                or in a format of a later release.
        """
        loaded = dict(state) or None
        running = self.running
        if running is not None and loaded is not None:
            running.load_state(loaded)
        elif running is not None:
            running.start_log()
        self._state = loaded


def _with_callback_name(owner: str, alarm: TrainingAlarm) -> str:
    """Begin the alarm's message with the callback's name and the rule.

    Lightning's warning formatter drops a warning's category when the warning comes from a path
    that contains "lightning", so the message itself must say where it comes from.
    """
    return f"{owner} [{alarm.rule}]: {alarm.message}"
