"""Release 0.2.0's ``GradFlowTracker(alarms=..., clip=...)``: a tracker that fed its own alarms.

Since then the tracker only measures, and an :class:`~.alarm_feed.AlarmFeed` made beside it
hands the alarms what they read. The old arguments still work, with a ``DeprecationWarning``:
the tracker then makes a :class:`DeprecatedTrackerAlarms` and passes it each step it observes.
"""

from __future__ import annotations

import warnings

import torch

from lightning_hooks.core.alarms import AlarmRules, TrainingAlarms
from lightning_hooks.core.clipping import Clip, as_clip
from lightning_hooks.core.stats.alarm_feed import AlarmFeed, Measured, Tracked

__all__ = ["DeprecatedTrackerAlarms", "deprecated_tracker_alarms"]

_OWNER = "GradFlowTracker"
_AT_THE_CALLER = 4
"""The warnings' stack level: this module's function, ``GradFlowTracker.__init__``, the check of
its keywords (:func:`~lightning_hooks.core.checks.named_arguments`), then the user's line."""


class DeprecatedTrackerAlarms:
    """The alarms a tracker made of ``GradFlowTracker(alarms=..., clip=...)``, and feeds itself.

    Args:
        tracker: the tracker whose measurements the alarms read.
        rules: the alarm rules.
        clip: the gradient clipping each step applies, or ``None``.
    """

    def __init__(self, tracker: Tracked, rules: AlarmRules, clip: Clip | None) -> None:
        self._feed = AlarmFeed(tracker, rules)
        self._clip = clip

    @property
    def training_alarms(self) -> TrainingAlarms:
        """Return the alarms, which the user polls (``tracker.alarms``)."""
        return self._feed.training_alarms

    def observe(
        self,
        optimizer: torch.optim.Optimizer,
        measured: Measured | None,
        *,
        step: int | None,
        grad_scale: torch.Tensor | None,
        param_grad_scale: torch.Tensor | None,
    ) -> None:
        """Pass the alarms what the tracker measured of ``optimizer``'s step.

        Args:
            optimizer: the optimizer about to step.
            measured: what the tracker's ``observe`` returned.
            step: the optimizer step the alarms name (``None``: they count the calls).
            grad_scale: the AMP loss scale, or ``None``.
            param_grad_scale: the loss scale the parameter gradients still carry, or ``None``.
        """
        self._feed.observe(
            optimizer,
            measured,
            step=step,
            grad_scale=grad_scale,
            param_grad_scale=param_grad_scale,
            clip=self._clip,
        )


def deprecated_tracker_alarms(
    tracker: Tracked,
    alarms: AlarmRules | None,
    clip: Clip | tuple[float, str] | None,
) -> DeprecatedTrackerAlarms | None:
    """Check the tracker's deprecated ``alarms`` and ``clip``, warn, and make the alarms.

    Args:
        tracker: the tracker being made.
        alarms: the tracker's ``alarms`` argument.
        clip: the tracker's ``clip`` argument, ``(bound, algorithm)``.

    Returns:
        The alarms the tracker feeds; ``None`` where ``alarms`` is not given.

    Raises:
        TypeError: ``alarms`` is neither an ``AlarmRules`` nor ``None``.
        ValueError: ``clip`` is not a positive bound and ``"norm"`` or ``"value"``.

    Warns:
        DeprecationWarning: ``alarms`` or ``clip`` is given.
    """
    if alarms is not None and not isinstance(alarms, AlarmRules):
        raise TypeError(
            f"{_OWNER}(alarms={alarms!r}): must be an AlarmRules or None, "
            f"got {type(alarms).__name__}"
        )
    checked = None if clip is None else as_clip(_OWNER, clip)
    if alarms is None:
        if checked is not None:
            warnings.warn(
                f"{_OWNER}(clip=...) is deprecated, and without alarms= it has no effect: "
                "give the clipping to the alarms' feed, feed.observe(optimizer, measured, "
                "clip=clip)",
                DeprecationWarning,
                stacklevel=_AT_THE_CALLER,
            )
        return None
    warnings.warn(
        f"{_OWNER}(alarms=..., clip=...) is deprecated: make the feed yourself, "
        "feed = AlarmFeed(tracker, rules), then feed.observe(optimizer, "
        "tracker.observe(optimizer), clip=clip) and feed.training_alarms.poll()",
        DeprecationWarning,
        stacklevel=_AT_THE_CALLER,
    )
    return DeprecatedTrackerAlarms(tracker, alarms, checked)
