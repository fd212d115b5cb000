"""Decide what ``GradFlowCallback`` does when an alarm fires, and write the alarms.

When an alarm fires, :class:`AlarmPolicy` takes its rule's action. The action warns, stops
the fit, raises, skips the optimizer step, or only logs the alarm. :class:`AlarmLog` writes the
alarms to the loggers. :mod:`.agreement` describes which loss the loss rules read under DDP.
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
# The rules an action can apply to. A notice is a rule whose alarms are only logged (see
# docs/glossary.md). Some notices take no action at all. amp_overflow takes none because the
# GradScaler already acts on it. A setback takes none because telling it from a divergence
# takes a few steps, and the *diverging* rule acts once the divergence is confirmed.
_ACTIONABLE = tuple(rule for rule in ALARM_RULES if rule not in NOTICES or NOTICES[rule].acts)
# Skipping an optimizer step does not cure what these rules find.
_NOT_SKIPPABLE = ("vanishing", "loss_spike", "diverging", "stall", "attention")
# Healthy runs also show one-step spikes and stalls (see benchmarks/divergence.py). So under
# "warn" these rules are notices, which are only logged. A spike that harms the optimizer also
# raises an *explosion* alarm, and that alarm warns.
_LOGGED = tuple(rule for rule in _ACTIONABLE if rule in NOTICES)
_SUMMARY_LINES = 100


def check_actions(on_alarm: object) -> dict[str, Action]:
    """Read ``on_alarm`` as an action per rule.

    A notice is a rule whose alarms are only logged by default (see docs/glossary.md). The
    notices *spike* and *stall* are only logged unless ``on_alarm`` names them, or unless it is
    the single action ``"skip"``. Skipping a spike's step is what ``"skip"`` is for. A single
    ``"stop"`` or ``"raise"`` therefore never ends a run on a notice, because healthy runs show
    notices too. Any other rule that a mapping does not name warns. A single ``"skip"`` warns
    for the rules that skipping cannot cure.

    Args:
        on_alarm: one action for every rule, or a mapping of rule to action.

    Returns:
        The action of every rule, by rule.

    Raises:
        ValueError: a rule or an action is unknown. The message names the allowed values.
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
    """Apply each rule's action to the alarms, as :func:`check_actions` reads ``on_alarm``.

    A callback makes a new policy for each fit, so that the warnings, the stop and the counts
    belong to that fit alone. A warning is given once per rule and layer in each epoch. Under
    DDP, ``stop`` and ``raise`` act on every rank. The :attr:`log` attribute writes the alarms
    to the loggers. The policy does not store the alarms. Each method that needs them is
    passed the fit's alarms.

    Args:
        actions: the action of every rule, as :func:`check_actions` reads ``on_alarm``.
        request_stop: called for a ``stop`` under DDP. The ranks agree on the stop at their
            next agreement.

    Example:
        >>> policy = AlarmPolicy(check_actions({"diverging": "stop"}), request_stop=lambda: None)
        >>> policy.actions["diverging"], policy.actions["vanishing"], policy.actions["spike"]
        ('stop', 'warn', 'log')
    """

    def __init__(self, actions: Mapping[str, Action], request_stop: Callable[[], None]) -> None:
        self.actions = dict(actions)
        self.log = AlarmLog(self.actions)
        """Writes the alarms to the loggers at each logging step and at each epoch end."""
        # ``skip`` must know the current step's verdict before the optimizer step runs, and
        # that costs a CUDA sync.
        self.wait = "skip" in self.actions.values()
        self._request_stop = request_stop  # under DDP, asks the ranks to agree on a stop
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
            trainer: the trainer. A ``stop`` stops it, and a ``skip`` applies only to an alarm
                of its current step.
            optimizer: the optimizer about to step. A ``skip`` drops its gradients. ``None``
                outside an optimizer step, where there is nothing to skip.
            alarms: the fit's alarms. Before a ``raise``, those since the last logging step
                are written.
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
                # Torch optimizers skip parameters whose gradient is ``None``, so clearing the
                # gradients makes the coming ``optimizer.step()`` do nothing.
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        param.grad = None
        if stop and world_size() == 1:
            trainer.should_stop = True
        elif stop:
            # The ranks agree on the stop in a collective the callback makes anyway, so no
            # host sync is needed here.
            self._request_stop()

    def announce_stop(self, trainer: TrainerView) -> None:
        """Say once, at the fit's end, whether an alarm's ``stop`` ended it.

        Without this warning, a fit that an alarm stopped looks like one that finished, except
        for its step count.

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
        """Write an alarm to the event files, then raise it as a :class:`TrainingAlarmError`.

        Args:
            trainer: the trainer whose loggers get the alarm before it is raised.
            alarms: the fit's alarms, whose alarms since the last logging step are written first.
            alarm: the alarm whose rule's action is ``"raise"``.

        Raises:
            TrainingAlarmError: always. If a logger fails to write, that failure becomes the
                error's cause instead of hiding it.
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

        The raising alarm is included. The alarm that ends the fit is then in the event files,
        where a check such as ``lightning-hooks report --fail-on`` can find it.

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
            alarm: the alarm. It is attached to the warning as ``warning.alarm``.
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
        self._warned.clear()  # in the next epoch, each rule and layer may warn once
        self.log.end_epoch(trainer, alarms)


class AlarmLog:
    """Write the alarms to the loggers: their counts per rule, and their text.

    A rule that takes an action is counted under ``grad_flow/alarms/<rule>``. A rule that is
    only logged, called a notice, is counted under ``grad_flow/notices/<rule>``. Each logging
    step writes what came since the previous one. Each epoch end writes the epoch's counts and a
    summary.

    Args:
        actions: each rule's action, as :func:`check_actions` returns it. A rule whose action
            is ``"log"`` is a notice.

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
        self._logged = 0  # how many alarms of the epoch's log are written
        self._counted: dict[str, int] = {}
        self._summary_step: int | None = None  # the step of this fit's last epoch summary

    def start(self, alarms: TrainingAlarms | None) -> None:
        """Start a fit from the current counts of its alarms, which are not new.

        The fit's alarms may continue the counts of a checkpoint or of the previous fit. A
        logging step writes only what they count beyond those.

        Args:
            alarms: the fit's alarms, after any saved state is loaded into them. ``None`` if
                the fit has no alarms.
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

        The counts and the summary are written at the epoch step
        (:func:`~.attached.epoch_step`). The summary goes under its own tag
        (:data:`~lightning_hooks.tags.ALARM_TEXT`), apart from the text of the logging steps. An
        epoch in which no batch made an optimizer step has the same epoch step as the epoch
        before it. Its summary would replace that epoch's summary, so it is not written.

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
    """Begin the alarm's message with the callback's name and the rule.

    Lightning's warning formatter drops a warning's category when the warning comes from a path
    that contains "lightning". The message itself must therefore say where it comes from.

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
        where: words that say what the text covers, such as a logging step or the epoch.
        noticed: the rules that only log (their lines are marked as notices).

    Returns:
        One line per alarm, made of its warning's first line, with notices marked as such.
        The alarm's details follow on indented lines. The ring buffer's lines (see
        docs/glossary.md) are added once per step.
    """
    lines: list[str] = []
    shown: set[int] = set()
    for alarm in log[:_SUMMARY_LINES]:
        first, *details = alarm.message.split("\n")
        kind = " (notice)" if alarm.rule in noticed else ""
        lines.append(f"- step {alarm.step}, {alarm.rule}{kind}, {alarm.layer}: {first}")
        lines += [f"    - {line}" for line in details]
        if alarm.history_steps and alarm.step not in shown:
            # Show the ring buffer once per step. For each row involved it gives the norm, and
            # in brackets the norm divided by the running scale.
            shown.add(alarm.step)
            lines += [f"    - {line}" for line in alarm.history_lines()]
    if len(log) > _SUMMARY_LINES:
        lines.append(f"- ... and {len(log) - _SUMMARY_LINES} more")
    notices = sum(alarm.rule in noticed for alarm in log)
    header = f"{len(log) - notices} warnings and {notices} notices {where}"
    return "\n".join([header, "", *lines])
