"""How ``GradFlowCallback``'s alarms are written: their counts per rule, and their text.

:class:`AlarmLog` writes each logging step's counts and text, and each epoch's counts and
summary, to the loggers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from lightning_hooks.callbacks.alarm_actions import Action
from lightning_hooks.callbacks.attached import epoch_step
from lightning_hooks.callbacks.trainer import TrainerView
from lightning_hooks.core.alarms import ALARM_RULES, TrainingAlarm, TrainingAlarms
from lightning_hooks.logging import log_scalars, log_text
from lightning_hooks.tags import (
    ALARM_STEP_TEXT,
    ALARM_TEXT,
    SPIKE_SCORE,
    alarm_tag,
    notice_tag,
    step_tags,
)

__all__ = ["AlarmLog", "Written"]

_SUMMARY_LINES = 100
"""The most alarms an epoch's summary lists one per line."""


class Written(NamedTuple):
    """What an :class:`AlarmLog` had written of an epoch's alarms by its last logging step."""

    counts: dict[str, int]
    """The counts per rule."""
    alarms: int
    """How many of the epoch's alarms (``TrainingAlarms.log``) were in the text."""


class AlarmLog:
    """Writes the alarms to the loggers: their counts per rule, and their text.

    A rule that takes an action is counted under ``grad_flow/alarms/<rule>``, a notice under
    ``grad_flow/notices/<rule>``. Each logging step writes what came since the previous one;
    each epoch end writes the epoch's counts and a summary.

    Args:
        actions: each rule's action. A rule whose action is ``"log"`` is a notice.

    Example:
        >>> from lightning_hooks.callbacks.alarm_actions import check_actions
        >>> log = AlarmLog(check_actions("warn", "GradFlowCallback"))
        >>> log.tags["diverging"], log.tags["spike"]
        ('grad_flow/alarms/diverging', 'grad_flow/notices/spike')
    """

    def __init__(self, actions: Mapping[str, Action]) -> None:
        self._noticed = {rule for rule in ALARM_RULES if actions.get(rule, "log") == "log"}
        self.tags = {
            rule: notice_tag(rule) if rule in self._noticed else alarm_tag(rule)
            for rule in ALARM_RULES
        }
        self._logged = 0  # how many alarms of the epoch's log are written
        self._counted: dict[str, int] = {}
        self._step_written: int | None = None  # the step of the last logging step's counts
        self._summary_step: int | None = None  # the step of this fit's last epoch summary

    def start(self, training_alarms: TrainingAlarms | None, written: Written | None = None) -> None:
        """Start a fit from what of its alarms is already written, after any state is loaded.

        A logging step writes only what the alarms count and log beyond it.

        Args:
            training_alarms: the rules' state, all of whose counts and alarms so far count as
                written where ``written`` is ``None``.
            written: what a checkpoint's fit had written by its last logging step (of the same
                epoch); the alarms it read after that step are written at the resumed fit's
                first logging step.
        """
        self._summary_step = None
        self._step_written = None
        counts = {} if training_alarms is None else training_alarms.counts
        logged = 0 if training_alarms is None else len(training_alarms.log)
        self._counted = dict(counts if written is None else written.counts)
        self._logged = logged if written is None else min(written.alarms, logged)

    def log_step(self, trainer: TrainerView, training_alarms: TrainingAlarms, step: int) -> None:
        """Log the per-rule counts since the last logging step, and on rank 0 the alarms' text.

        Args:
            trainer: the trainer whose loggers are written to.
            training_alarms: the rules' state, whose counts are read.
            step: the logging step the counts are written at.
        """
        counts = {
            rule: n - self._counted.get(rule, 0) for rule, n in training_alarms.counts.items()
        }
        self._counted = dict(training_alarms.counts)
        self._step_written = step
        tags = step_tags({self.tags[rule]: n for rule, n in counts.items()})
        log_scalars(trainer.loggers, tags, step)
        new = training_alarms.log[self._logged :]
        self._logged = len(training_alarms.log)
        if new and trainer.is_global_zero:
            summary = _summary(new, f"up to step {step}", self._noticed)
            log_text(trainer.loggers, ALARM_STEP_TEXT, summary, step)

    def end_epoch(self, trainer: TrainerView, training_alarms: TrainingAlarms) -> None:
        """Take the epoch's alarms, and log its counts and its text summary.

        Both are written at :func:`~.attached.epoch_step`; rank 0 writes the summary under
        :data:`~lightning_hooks.tags.ALARM_TEXT`. An epoch with no optimizer step shares the
        previous epoch's step, and its summary would replace that one's, so it is not written.
        What the alarms read after the epoch's last logging step is first written as a logging
        step's counts and text would be, at the epoch's step, unless a logging step was written
        there already.

        Args:
            trainer: the trainer whose loggers are written to.
            training_alarms: the rules' state, whose epoch is taken.
        """
        step = epoch_step(trainer)
        if step != self._step_written and self._unwritten(training_alarms):
            self.log_step(trainer, training_alarms, step)
        counts, log = training_alarms.take_epoch()
        self._logged = 0
        self._counted = {}
        scalars = {self.tags[rule]: float(n) for rule, n in counts.items()}
        scalars[SPIKE_SCORE] = training_alarms.spike_score
        log_scalars(trainer.loggers, scalars, step)
        repeated = step == self._summary_step
        self._summary_step = step
        if trainer.is_global_zero and not repeated:
            where = f"in epoch {trainer.current_epoch}"
            log_text(trainer.loggers, ALARM_TEXT, _summary(log, where, self._noticed), step)

    @property
    def written(self) -> Written:
        """Return what the last logging step had written of the epoch, for a checkpoint."""
        return Written(dict(self._counted), self._logged)

    def _unwritten(self, training_alarms: TrainingAlarms) -> bool:
        """Return whether the alarms counted or logged any alarm since the last logging step."""
        if len(training_alarms.log) > self._logged:
            return True
        counted = self._counted
        return any(n != counted.get(rule, 0) for rule, n in training_alarms.counts.items())


def _summary(log: list[TrainingAlarm], where: str, noticed: set[str]) -> str:
    """Write the alarms' text for the event files, after a header that says ``where``.

    Each alarm has one line, its warning's first line, with notices marked as such, and its
    details on indented lines. The ring buffer's lines are added once per step.
    """
    lines: list[str] = []
    shown: set[int] = set()
    for alarm in log[:_SUMMARY_LINES]:
        first, *details = alarm.message.split("\n")
        kind = " (notice)" if alarm.rule in noticed else ""
        lines.append(f"- step {alarm.step}, {alarm.rule}{kind}, {alarm.layer}: {first}")
        lines += [f"    - {line}" for line in details]
        if alarm.history_steps and alarm.step not in shown:
            # Per row: the norm, and in brackets the norm over the running scale.
            shown.add(alarm.step)
            lines += [f"    - {line}" for line in alarm.history_lines()]
    if len(log) > _SUMMARY_LINES:
        lines.append(f"- ... and {len(log) - _SUMMARY_LINES} more")
    notices = sum(alarm.rule in noticed for alarm in log)
    header = f"{len(log) - notices} warnings and {notices} notices {where}"
    return "\n".join([header, "", *lines])
