"""A *setback* of the loss: its record and the lines it writes.

A setback is a rise over *diverging*'s bar, held open until the loss comes back or the rise is
confirmed as a divergence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_hooks.core.alarms.messages import TrainingAlarm, ratio_text
from lightning_hooks.core.alarms.rules import AlarmRules

__all__ = ["Setback", "setback_opened", "setback_recovered"]


@dataclass
class Setback:
    """A rise of the loss's running mean over *diverging*'s bar.

    Open until it falls back (a recovery) or is confirmed (a divergence).
    """

    start: int
    """The optimizer step it opened at."""
    best: float
    """The best level when it opened."""
    peak: float
    """The highest short running mean of the loss since it opened."""
    steps: int = 0
    """Its optimizer steps whose mean loss is over the bar itself (not only the running mean,
    which remembers an earlier loss); with one loss a step, its losses over the bar."""
    confirmed: bool = False
    """Confirmed as a divergence: *diverging* warns while it holds."""
    jump: float = -math.inf
    """The highest single step's mean loss among its steps counted over the bar: an outlier
    batch's own loss, which the echo that follows it does not pass (unlike :attr:`peak`, a
    step's own mean, not the running mean)."""


def setback_opened(
    step: int, setback: Setback, mean: float, first: float, rules: AlarmRules
) -> TrainingAlarm:
    """Write a setback's first line: where the loss rose to from its best, and what is watched.

    Args:
        step: the optimizer step it opened at.
        setback: the setback opened, whose best the line quotes.
        mean: the loss's running mean now.
        first: where the run started, the base of *diverging*'s ``diverge_lost``.
        rules: the alarm rules, whose thresholds the line quotes.

    Returns:
        The line, a *setback* alarm.
    """
    best = setback.best
    rise = ratio_text(mean / best) if best > 0 else f"+{mean - best:.4g}"
    text = (
        f"loss setback at optimizer step {step}: its running mean {mean:.4g} rose {rise} over "
        f"its best {setback.best:.4g}; watched, not warned: most setbacks recover"
    )
    details = (
        "the rise is past the loss's own step-to-step noise",
        f"it becomes a divergence if it holds for {rules.diverge_patience} optimizer steps "
        f"(diverge_patience), its last steps' median loss passes {rules.diverge_lost:g}x where "
        f"the run started ({first:.4g}; diverge_lost), or the loss is not finite",
    )
    return TrainingAlarm("setback", "loss", step, mean, setback.best, text, details=details)


def setback_recovered(step: int, setback: Setback, mean: float) -> TrainingAlarm:
    """Write a setback's last line when the loss's running mean came back.

    A line of text, not counted again.

    Args:
        step: the optimizer step it recovered at.
        setback: the setback closed, whose start, peak, best and steps the line quotes.
        mean: the loss's running mean now.

    Returns:
        The line, a *setback* alarm that does not count.
    """
    text = (
        f"loss setback of optimizer step {setback.start} recovered at step {step}: its running "
        "mean fell back below the bar; no action needed"
    )
    details = (
        f"it peaked at {setback.peak:.4g} (its best {setback.best:.4g}), {setback.steps} "
        "step(s) over the bar",
    )
    return TrainingAlarm(
        "setback", "loss", step, mean, setback.best, text, counts=False, details=details
    )
