"""Decide what ``GradFlowCallback`` does when an alarm fires, and write the alarms.

An alarm is warned of, stops the fit, raises, skips its step or is only logged
(:class:`AlarmPolicy`), and it is written to the loggers (:class:`AlarmLog`). What its loss
rules read under DDP is in :mod:`.agreement`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Literal

import torch
from pytorch_lightning.utilities import rank_zero_warn

from lightning_hooks.callbacks.attached import epoch_step
from lightning_hooks.callbacks.trainer import TrainerView
from lightning_hooks.core.alarms import ALARM_RULES, TrainingAlarm, TrainingAlarms
from lightning_hooks.core.transport import (
    world_size,
)
from lightning_hooks.errors import TrainingAlarmError, TrainingAlarmWarning
from lightning_hooks.logging import log_scalars, log_text, save_loggers
from lightning_hooks.tags import (
    ALARM_STEP_TEXT,
    ALARM_TEXT,
    NOTICES,
    SPIKE_SCORE,
    alarm_tag,
    notice_tag,
    step_tags,
)

__all__ = ["Action", "AlarmLog", "AlarmPolicy", "check_actions"]

Action = Literal["warn", "stop", "raise", "skip", "log"]
_ACTIONS: tuple[Action, ...] = ("warn", "stop", "raise", "skip", "log")
# The notices no action applies to (amp_overflow: the GradScaler already acts; a setback: telling
# it from a divergence takes a few steps, and *diverging* acts once it is confirmed).
_ACTIONABLE = tuple(rule for rule in ALARM_RULES if rule not in NOTICES or NOTICES[rule].acts)
_NOT_SKIPPABLE = ("vanishing", "loss_spike", "diverging", "stall", "attention")  # skip cures none
# Healthy runs show one-step spikes and stalls too (benchmarks/divergence.py): under "warn" they
# are notices, only logged; a spike that hurts the optimizer is also an *explosion*, which warns.
_LOGGED = tuple(rule for rule in _ACTIONABLE if rule in NOTICES)
_SUMMARY_LINES = 100


def check_actions(on_alarm: object) -> dict[str, Action]:
    """Read ``on_alarm`` as an action per rule.

    Unnamed rules warn. The notices *spike* and *stall* log unless named, or unless the one
    action is ``"skip"`` (skipping a spike's step is what it is for): one ``"stop"`` or
    ``"raise"`` never ends a run on a notice, which healthy runs show too. ``"skip"`` warns for
    the rules it cannot cure.

    Args:
        on_alarm: one action for every rule, or a mapping of rule to action.

    Returns:
        The action of every rule, by rule.

    Raises:
        ValueError: an unknown rule or action, naming the allowed values.
        TypeError: ``on_alarm`` is neither a string nor a mapping.

    Example:
        >>> check_actions("skip")["vanishing"], check_actions("warn")["spike"]
        ('warn', 'log')
        >>> check_actions("stop")["diverging"], check_actions("stop")["spike"]
        ('stop', 'log')
        >>> check_actions({"spike": "stop"})["spike"]
        'stop'
    """
    if not isinstance(on_alarm, str | Mapping):
        raise TypeError(
            f"GradFlowCallback(on_alarm={on_alarm!r}): must be one of {_ACTIONS} or a mapping "
            f"{{rule: action}} with rules in {_ACTIONABLE}, got {on_alarm!r}"
        )
    if isinstance(on_alarm, str) and on_alarm not in _ACTIONS:
        close = difflib.get_close_matches(on_alarm, _ACTIONS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"GradFlowCallback(on_alarm={on_alarm!r}): must be one of {_ACTIONS} or a mapping "
            f"{{rule: action}}, got {on_alarm!r}{hint}"
        )
    given = dict.fromkeys(_ACTIONABLE, on_alarm) if isinstance(on_alarm, str) else on_alarm
    if on_alarm == "skip":
        given = {**given, **dict.fromkeys(_NOT_SKIPPABLE, "warn")}
    if on_alarm in ("warn", "stop", "raise"):
        given = {**given, **dict.fromkeys(_LOGGED, "log")}
    actions: dict[str, Action] = {
        **dict.fromkeys(_ACTIONABLE, "warn"),
        **dict.fromkeys(_LOGGED, "log"),
    }
    for rule, action in given.items():
        if rule not in _ACTIONABLE:
            raise ValueError(
                f"GradFlowCallback(on_alarm={on_alarm!r}): rules must be in {_ACTIONABLE}, "
                f"got {rule!r}"
            )
        skippable = rule not in _NOT_SKIPPABLE
        if action not in _ACTIONS or (action == "skip" and not skippable):
            allowed = _ACTIONS if skippable else tuple(a for a in _ACTIONS if a != "skip")
            raise ValueError(
                f"GradFlowCallback(on_alarm={on_alarm!r}): the action for {rule!r} must be in "
                f"{allowed}, got {action!r}"
            )
        actions[rule] = action
    return actions


class AlarmPolicy:
    """Apply each rule's action (``on_alarm``, read by :func:`check_actions`) to the alarms.

    A callback makes one for each fit, so that its warnings, its stop and its counts belong to
    that fit alone. A warning is given once per rule and layer per epoch; under DDP, ``stop``
    and ``raise`` act on every rank. Its :attr:`log` writes the alarms to the loggers. It holds
    no alarms: each call is handed the fit's.

    Args:
        actions: the action of every rule, as :func:`check_actions` reads ``on_alarm``.
        request_stop: called for a ``stop`` under DDP, for the ranks to agree on at their next
            agreement.

    Example:
        >>> policy = AlarmPolicy(check_actions({"diverging": "stop"}), request_stop=lambda: None)
        >>> policy.actions["diverging"], policy.actions["vanishing"], policy.actions["spike"]
        ('stop', 'warn', 'log')
    """

    def __init__(self, actions: Mapping[str, Action], request_stop: Callable[[], None]) -> None:
        self.actions = dict(actions)
        self.log = AlarmLog(self.actions)
        """What is written of the alarms to the loggers, at each logging step and epoch end."""
        # ``skip`` needs the current step's verdict before the optimizer step (a CUDA sync)
        self.wait = "skip" in self.actions.values()
        self._request_stop = request_stop  # under DDP: a ``stop`` for the ranks to agree on
        self._warned: set[tuple[str, str]] = set()
        self.stopped_by: TrainingAlarm | None = None  # the first alarm whose ``stop`` acted

    def act(
        self,
        trainer: TrainerView,
        optimizer: torch.optim.Optimizer | None,
        alarms: TrainingAlarms,
        found: list[TrainingAlarm],
    ) -> None:
        """Warn, stop, raise or skip for each alarm found, as its rule's action says.

        Args:
            trainer: the trainer that is stopped, and whose step a ``skip`` must match.
            optimizer: the optimizer about to step, whose gradients a ``skip`` drops (``None``:
                outside an optimizer step, nothing to skip).
            alarms: the fit's alarms, whose alarms since the last logging step are written
                before a ``raise``.
            found: the alarms read from them, in the order they were raised.

        Raises:
            TrainingAlarmError: an alarm's rule has the action ``"raise"``.
        """
        stop = False
        for alarm in found:
            action = self.actions.get(alarm.rule)
            if action is None or action == "log":
                continue
            if action == "raise":
                self._raise(trainer, alarms, alarm)
            self._warn_once(alarm)
            if action == "stop" and self.stopped_by is None:
                self.stopped_by = alarm
            stop = stop or action == "stop"
            if action == "skip" and optimizer is not None and alarm.step == trainer.global_step:
                # the coming ``optimizer.step()`` a no-op: torch optimizers skip ``None`` gradients
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        param.grad = None
        if stop and world_size() == 1:
            trainer.should_stop = True
        elif stop:
            # agreed on a collective the callback makes anyway: no host sync here
            self._request_stop()

    def announce_stop(self, trainer: TrainerView) -> None:
        """Say once, at the fit's end, whether an alarm's ``stop`` ended it.

        A fit that stops looks like one that finished, but for the step count.

        Args:
            trainer: the trainer whose ``should_stop`` and ``global_step`` the warning reads.
        """
        alarm = self.stopped_by
        self.stopped_by = None
        if alarm is not None and trainer.should_stop:
            rank_zero_warn(
                f"GradFlowCallback [{alarm.rule}]: on_alarm='stop' ended the fit at optimizer "
                f"step {trainer.global_step}, after the {alarm.rule} alarm of step {alarm.step}:\n"
                f"{alarm.message}",
                category=TrainingAlarmWarning,
            )

    def _raise(self, trainer: TrainerView, alarms: TrainingAlarms, alarm: TrainingAlarm) -> None:
        """Raise an alarm as a :class:`TrainingAlarmError`, once it is in the event files.

        Args:
            trainer: the trainer whose loggers get the alarm before it is raised.
            alarms: the fit's alarms, whose alarms since the last logging step are written first.
            alarm: the alarm whose rule's action is ``"raise"``.

        Raises:
            TrainingAlarmError: always; a logger that fails to write is its cause, and does not
                hide it.
        """
        error = TrainingAlarmError(
            _speaker(alarm),
            rule=alarm.rule,
            layer=alarm.layer,
            step=alarm.step,
            value=alarm.value,
            alarm=alarm,
        )
        try:
            self._keep_before_raising(trainer, alarms, alarm.step)
        except Exception as failure:
            raise error from failure
        raise error

    def _keep_before_raising(self, trainer: TrainerView, alarms: TrainingAlarms, step: int) -> None:
        """Write the alarms since the last logging step, and save the loggers, before a raise.

        The raising alarm is included: the alarm that ends the fit is then in the event files,
        and a gate on them (``lightning-hooks report --fail-on``) sees it.

        Args:
            trainer: the trainer whose loggers are written to and saved.
            alarms: the fit's alarms, whose counts and log are written.
            step: the raising alarm's step, which the counts and text are written at.
        """
        self.log.log_step(trainer, alarms, step)
        save_loggers(trainer.loggers)

    def _warn_once(self, alarm: TrainingAlarm) -> None:
        """Warn of an alarm, once per rule and layer in an epoch.

        Args:
            alarm: the alarm, attached to the warning it raises.
        """
        key = (alarm.rule, alarm.layer)
        if key not in self._warned:
            self._warned.add(key)
            warning = TrainingAlarmWarning(_speaker(alarm))
            warning.alarm = alarm
            rank_zero_warn(warning, category=TrainingAlarmWarning)

    def end_epoch(self, trainer: TrainerView, alarms: TrainingAlarms) -> None:
        """Act on the epoch's last verdicts, then write its alarms and start the next epoch.

        Args:
            trainer: the trainer the alarms act on and whose loggers are written to.
            alarms: the fit's alarms, whose epoch is taken and started afresh.

        Raises:
            TrainingAlarmError: a last verdict's rule has the action ``"raise"``.
        """
        self.act(trainer, None, alarms, alarms.poll(wait=True))
        self._warned.clear()  # each epoch warns of a rule and layer once again
        self.log.end_epoch(trainer, alarms)


class AlarmLog:
    """Write the alarms to the loggers: their counts per rule, and their text.

    A rule that acts is counted under ``grad_flow/alarms/<rule>``, a rule only logged (a notice)
    under ``grad_flow/notices/<rule>``. Each logging step writes what came since the last one;
    each epoch end writes the epoch's counts and a summary.

    Args:
        actions: each rule's action (:func:`check_actions`): which rules are only notices.

    Example:
        >>> log = AlarmLog(check_actions("warn"))
        >>> log.tags["diverging"], log.tags["spike"]
        ('grad_flow/alarms/diverging', 'grad_flow/notices/spike')
    """

    def __init__(self, actions: Mapping[str, Action]) -> None:
        self._noticed = {rule for rule in ALARM_RULES if actions.get(rule, "log") == "log"}
        self.tags = {
            rule: notice_tag(rule) if rule in self._noticed else alarm_tag(rule)
            for rule in ALARM_RULES
        }
        """Each rule's tag: under ``alarms`` when it acts, else under ``notices``."""
        self._logged = 0  # alarms of the epoch's log already written at a logging step
        self._counted: dict[str, int] = {}
        self._summary_step: int | None = None  # the step of this fit's last epoch summary

    def start(self, alarms: TrainingAlarms | None) -> None:
        """Start a fit from its alarms as they stand: what they already count is not new.

        The fit's alarms may continue a checkpoint's counts, or the last fit's; a logging step
        writes only what they count beyond those.

        Args:
            alarms: the fit's alarms, once their carried state is loaded (``None``: none).
        """
        self._summary_step = None
        self._counted = {} if alarms is None else dict(alarms.counts)
        self._logged = 0 if alarms is None else len(alarms.log)

    def log_step(self, trainer: TrainerView, alarms: TrainingAlarms, step: int) -> None:
        """Log the per-rule counts since the last logging step, and any alarms' text.

        Args:
            trainer: the trainer whose loggers are written to; only rank 0 writes the text.
            alarms: the fit's alarms, whose counts and log are read.
            step: the logging step the values are written at.
        """
        counts = {rule: n - self._counted.get(rule, 0) for rule, n in alarms.counts.items()}
        self._counted = dict(alarms.counts)
        tags = step_tags({self.tags[rule]: n for rule, n in counts.items()})
        log_scalars(trainer.loggers, tags, step)
        new = alarms.log[self._logged :]
        self._logged = len(alarms.log)
        if new and trainer.is_global_zero:
            summary = _summary(new, f"up to step {step}", self._noticed)
            log_text(trainer.loggers, ALARM_STEP_TEXT, summary, step)

    def end_epoch(self, trainer: TrainerView, alarms: TrainingAlarms) -> None:
        """Take the epoch's alarms, and log its counts and its text summary.

        They are written at the epoch's step (:func:`~.attached.epoch_step`), the summary under
        its own tag (:data:`~lightning_hooks.tags.ALARM_TEXT`), apart from the logging steps'
        text. An epoch in which no batch stepped has the step of the epoch before it, and ran no
        training step: its summary, which would take the place of that epoch's, is not written.

        Args:
            trainer: the trainer whose loggers are written to; only rank 0 writes the text.
            alarms: the fit's alarms, whose epoch is taken and started afresh.
        """
        counts, log = alarms.take_epoch()
        self._logged = 0
        self._counted = {}
        step = epoch_step(trainer)
        scalars = {self.tags[rule]: float(n) for rule, n in counts.items()}
        scalars[SPIKE_SCORE] = alarms.spike_score
        log_scalars(trainer.loggers, scalars, step)
        repeated = step == self._summary_step
        self._summary_step = step
        if trainer.is_global_zero and not repeated:
            where = f"in epoch {trainer.current_epoch}"
            log_text(trainer.loggers, ALARM_TEXT, _summary(log, where, self._noticed), step)


def _speaker(alarm: TrainingAlarm) -> str:
    """Put who speaks before the alarm's message: the callback and the rule.

    Lightning's warning formatter drops a warning's category under a path containing
    "lightning", so the words themselves must say it.

    Args:
        alarm: the alarm, whose rule and message are read.

    Returns:
        The message, beginning with ``GradFlowCallback [rule]``.
    """
    return f"GradFlowCallback [{alarm.rule}]: {alarm.message}"


def _summary(log: list[TrainingAlarm], where: str, noticed: set[str]) -> str:
    """Write the alarms' text for the event files.

    Args:
        log: the alarms, in the order they were raised.
        where: the clause saying where the text stands (a logging step or the epoch).
        noticed: the rules that only log (their lines are marked as notices).

    Returns:
        A line per alarm (its warning's first line; a notice marked so), its details under it,
        and the ring buffer's lines once per step.
    """
    lines: list[str] = []
    shown: set[int] = set()
    for alarm in log[:_SUMMARY_LINES]:
        first, *details = alarm.message.split("\n")
        kind = " (notice)" if alarm.rule in noticed else ""
        lines.append(f"- step {alarm.step}, {alarm.rule}{kind}, {alarm.layer}: {first}")
        lines += [f"    - {line}" for line in details]
        if alarm.history_steps and alarm.step not in shown:
            # the ring buffer once per step: norm (norm / running scale) of the rows involved
            shown.add(alarm.step)
            lines += [f"    - {line}" for line in alarm.history_lines()]
    if len(log) > _SUMMARY_LINES:
        lines.append(f"- ... and {len(log) - _SUMMARY_LINES} more")
    notices = sum(alarm.rule in noticed for alarm in log)
    header = f"{len(log) - notices} warnings and {notices} notices {where}"
    return "\n".join([header, "", *lines])
